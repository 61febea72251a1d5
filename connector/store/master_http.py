"""The Mooncake master's HTTP admin port (`--metrics_port`): which keys it holds, asked
without a lease (`/batch_query_keys`), for the KV events' removal sweep and the preflight.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Sequence

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


def quote(text: str) -> str:
    """`urllib.parse.quote(text, safe="")`, the same for every input: the standard library
    quotes byte by byte in Python, which cost a sweep round most of its CPU (a store key is
    about a hundred characters, a query 64 keys). ASCII text is scanned once for the few
    characters to escape, each then replaced in C ('%' first, as the escapes bring more);
    other text goes to the standard library."""
    if not text.isascii():
        return urllib.parse.quote(text, safe="")
    escape = set(text).difference(_UNRESERVED)
    if "%" in escape:
        text = text.replace("%", "%25")
        escape.discard("%")
    for c in escape:
        text = text.replace(c, f"%{ord(c):02X}")
    return text


class MasterKeys:
    """Which keys the master holds a complete replica of (memory or disk), from its HTTP admin
    port's /batch_query_keys (grants no lease), over one kept-alive connection. Raises on any
    failure (and reconnects on the next query)."""

    def __init__(self, master_http: str, timeout: float = 5.0) -> None:
        host, _, port = master_http.rpartition(":")
        self._host, self._port, self._timeout = host, int(port), timeout
        self._conn: http.client.HTTPConnection | None = None

    def query(self, keys: Sequence[str]) -> dict[str, bool]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self._host, self._port,
                                                    timeout=self._timeout)
        try:
            self._conn.request("GET", "/batch_query_keys?keys="
                               + quote(",".join(keys)))
            resp = self._conn.getresponse()
            raw = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"batch_query_keys answered HTTP {resp.status}")
        except Exception:
            self.close()
            raise
        body = json.loads(raw)
        if not body.get("success"):
            raise RuntimeError(f"batch_query_keys answered {str(body)[:200]}")
        data = body.get("data") or {}
        return {k: bool(v.get("ok") and (v.get("values") or v.get("disk_values")
                                         or v.get("local_disk_values")))
                for k, v in data.items()}

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def query_keys(master_http: str, keys: Sequence[str], timeout: float = 5.0) -> dict[str, bool]:
    """One query of `MasterKeys` on a connection of its own."""
    client = MasterKeys(master_http, timeout)
    try:
        return client.query(keys)
    finally:
        client.close()
