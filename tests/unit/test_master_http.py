"""The admin-port query's URL quoting (connector/store/master_http.py): the same as the
standard library's `quote(text, safe="")` for every input, which the master decodes."""

from __future__ import annotations

import random
import urllib.parse

from connector.store.master_http import quote


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
