"""The admin-port query (connector/store/master_http.py): its URL quoting is the standard
library's `quote(text, safe="")` for every input, which the master decodes; its reading of
the answers is what the whole JSON says."""

from __future__ import annotations

import http.server
import json
import random
import threading
import urllib.parse

import msgspec
import pytest

from connector.store.master_http import MasterKeys, UrlTooLong, held, quote


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


def test_a_refused_long_url_is_told_apart_and_the_next_query_reconnects():
    """A proxy's 414 (or 431) is `UrlTooLong`, which the sweep answers with shorter queries;
    another status is a plain failure; either way the next query works on a new connection.
    (A stand-in for a proxy in front of the admin port: the master takes long URLs.)"""

    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            keys = urllib.parse.unquote(self.path.partition("keys=")[2]).split(",")
            status, body = (414, b"") if len(self.path) > 200 else (
                (500, b"") if keys == ["boom"] else
                (200, json.dumps({"success": True, "data": {
                    k: {"ok": True, "values": [REPLICA]} for k in keys}}).encode()))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = MasterKeys(f"127.0.0.1:{server.server_address[1]}")
    try:
        assert client.query(["a/1", "b/2"]) == {"a/1": True, "b/2": True}
        with pytest.raises(UrlTooLong, match="HTTP 414 to 40 keys"):
            client.query([f"key/{i:04d}" for i in range(40)])
        with pytest.raises(RuntimeError, match="HTTP 500") as failed:
            client.query(["boom"])
        assert not isinstance(failed.value, UrlTooLong)
        assert client.query(["c/3"]) == {"c/3": True}
    finally:
        client.close()
        server.shutdown()
        server.server_close()
