"""The admin-port query (connector/store/master_http.py): its URL quoting is the standard
library's `quote(text, safe="")` for every input, which the master decodes; its reading of
the answers is what the whole JSON says."""

from __future__ import annotations

import json
import random
import urllib.parse

import msgspec
import pytest

from connector.store.master_http import held, quote


def test_quote_is_the_standard_librarys():
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(128)] + ["é", "ü", "€", "日", "\U0001f600"]
    texts = ["", "%", "%25", "a/b,c", "mcpool/llama-70b/bf16/g0/s0/" + "ab" * 32,
             "model/with%percent,and spaces"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(60)))
              for _ in range(2000)]
    texts += ["".join(rng.choice("a/%,:~-") for _ in range(rng.randrange(30)))
              for _ in range(2000)]
    for text in texts:
        assert quote(text) == urllib.parse.quote(text, safe=""), repr(text)


REPLICA = {"size_": 1, "buffer_address_": 139849302540291, "protocol_": "tcp",
           "transport_endpoint_": "127.0.0.1:12851"}


def _answer(rng: random.Random, i: int) -> dict:
    """One key's answer as the master writes it: found or not, replicas in some tiers."""
    tiers = {t: rng.choice([None, [], [REPLICA], [REPLICA, REPLICA]])
             for t in ("values", "disk_values", "local_disk_values", "nof_values")}
    return {"ok": rng.random() < 0.8, "error": None if i % 3 else "OBJECT_NOT_FOUND", **tiers}


def test_held_is_what_the_whole_answer_says():
    """Against the answers decoded whole (json.loads, as before): a key is held when the
    master found it and some memory or disk tier lists a replica."""
    rng = random.Random(3)
    for _ in range(300):
        body = {"success": True,
                "data": {f"k{i}": _answer(rng, i) for i in range(rng.randrange(70))}}
        raw = json.dumps(body).encode()
        whole = json.loads(raw)["data"]
        assert held(raw) == {k: bool(v["ok"] and (v["values"] or v["disk_values"]
                                                  or v["local_disk_values"]))
                             for k, v in whole.items()}


def test_an_answer_not_a_success_or_of_another_shape_raises():
    with pytest.raises(RuntimeError, match="batch_query_keys answered"):
        held(b'{"success": false, "error": "bad keys"}')
    with pytest.raises(msgspec.ValidationError):
        held(b'{"success": true, "data": {"k": {"ok": true, "values": "yes"}}}')
