"""Make a small Llama checkpoint locally: random weights (fixed seed) and a BPE tokenizer
trained on generated text. No hub download; the same arguments give the same files.

`python -m devkit.tiny_model OUT_DIR [--layers N --hidden H]`
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


def _corpus(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def make_tiny_llama(
    out_dir: str | Path,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    seed: int = 0,
) -> Path:
    """Write config, safetensors weights and tokenizer files to out_dir (idempotent)."""
    out = Path(out_dir)
    marker = out / "tiny_model.json"
    spec = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                seed=seed)
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
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

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    a = p.parse_args()
    print(make_tiny_llama(a.out_dir, a.layers, a.hidden, a.heads, a.kv_heads))


if __name__ == "__main__":
    main()
