"""Make small checkpoints locally: random weights (fixed seed) and a BPE tokenizer trained on
generated text. No hub download; the same arguments give the same files.

- `make_tiny_llama`: a Llama; with `sliding_window`, every other layer (from the first) is a
  sliding-window layer beside full-attention ones (HF `layer_types`), so vLLM's hybrid KV
  cache manager gives it two KV cache groups.
- `make_tiny_mla`: a DeepSeek-V2 with multi-head latent attention (one latent KV per token,
  the same on every TP rank), at the latent size vLLM's CPU MLA kernel supports (512 + 64).

`python -m devkit.tiny_model OUT_DIR [--layers N --hidden H --sliding-window W | --mla]`
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "cache store block token prefix master thread queue load save layer head model engine "
    "request batch key value memory network segment transfer latency metric trace span pool "
    "alpha beta gamma delta kernel tensor page shard replica lease node client server"
).split()

MAX_POSITIONS = 4096  # every tiny model's context: vLLM refuses a longer --max-model-len


def _corpus(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def _tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)


def _write(out_dir: str | Path, spec: dict, build) -> Path:
    """Write the model `build()` returns, unless out_dir already holds `spec`'s."""
    out = Path(out_dir)
    marker = out / "tiny_model.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    import torch

    out.mkdir(parents=True, exist_ok=True)
    _tokenizer(out, spec["vocab"])
    torch.manual_seed(spec["seed"])
    build().to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return out


def make_tiny_llama(
    out_dir: str | Path,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    seed: int = 0,
    sliding_window: int = 0,
) -> Path:
    """Write config, safetensors weights and tokenizer files to out_dir (idempotent)."""
    spec = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                seed=seed)
    if sliding_window:
        spec["sliding_window"] = sliding_window

    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        hybrid = {"sliding_window": sliding_window, "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        } if sliding_window else {}
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=MAX_POSITIONS, bos_token_id=1, eos_token_id=2,
            torch_dtype="bfloat16", tie_word_embeddings=False, **hybrid))

    return _write(out_dir, spec, build)


def make_tiny_mla(out_dir: str | Path, layers: int = 2, hidden: int = 128, heads: int = 2,
                  vocab: int = 1024, seed: int = 0) -> Path:
    """A dense DeepSeek-V2 (no MoE layers) with MLA: kv_lora_rank 512 + rope 64 = the 576-wide
    latent vLLM's CPU MLA backend supports."""
    spec = dict(arch="deepseek_v2", layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                seed=seed)

    def build():
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        return DeepseekV2ForCausalLM(DeepseekV2Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
            moe_intermediate_size=hidden, num_hidden_layers=layers, first_k_dense_replace=layers,
            num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=512,
            q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            n_routed_experts=1, max_position_embeddings=MAX_POSITIONS, bos_token_id=1,
            eos_token_id=2, torch_dtype="bfloat16", tie_word_embeddings=False))

    return _write(out_dir, spec, build)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--sliding-window", type=int, default=0)
    p.add_argument("--mla", action="store_true", help="a DeepSeek-V2 MLA model instead")
    a = p.parse_args()
    print(make_tiny_mla(a.out_dir, a.layers, a.hidden, a.heads) if a.mla else
          make_tiny_llama(a.out_dir, a.layers, a.hidden, a.heads, a.kv_heads,
                          sliding_window=a.sliding_window))


if __name__ == "__main__":
    main()
