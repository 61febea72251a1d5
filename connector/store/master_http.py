"""The Mooncake master's HTTP admin port (`--metrics_port`): which keys it holds, asked
without a lease (`/batch_query_keys`), for the KV events' removal sweep and the preflight.
"""

from __future__ import annotations

import http.client
import urllib.parse
from collections.abc import Sequence

import msgspec

_UNRESERVED = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~"
_PERCENT = ord("%")


def quote(text: str) -> str:
    """`urllib.parse.quote(text, safe="")`, the same for every input: the standard library
    quotes byte by byte in Python, which cost a sweep round most of its CPU (a store key is
    about a hundred characters, a query hundreds of keys). ASCII text keeps only the bytes to escape
    (one `bytes.translate` in C), each then replaced in C ('%' first, as the escapes bring
    more); other text goes to the standard library."""
    if not text.isascii():
        return urllib.parse.quote(text, safe="")
    escape = set(text.encode("ascii").translate(None, _UNRESERVED))
    if _PERCENT in escape:
        text = text.replace("%", "%25")
        escape.discard(_PERCENT)
    for c in escape:
        text = text.replace(chr(c), f"%{c:02X}")
    return text


class _Replicas(msgspec.Struct):
    """One key's answer: whether the master found it, and its replicas per tier. Only whether
    a list is empty matters, so each replica stays undecoded JSON (`msgspec.Raw`)."""

    ok: bool = False
    values: list[msgspec.Raw] | None = None
    disk_values: list[msgspec.Raw] | None = None
    local_disk_values: list[msgspec.Raw] | None = None


class _Answer(msgspec.Struct):
    success: bool = False
    data: dict[str, _Replicas] | None = None


# A typed decoder that builds no object per replica: json.loads of the answers (a few
# hundred bytes of replica descriptors per key) was a large part of a sweep round's CPU.
_DECODE = msgspec.json.Decoder(_Answer).decode


def held(raw: bytes) -> dict[str, bool]:
    """A /batch_query_keys answer: each key asked, and whether the master holds a complete
    replica of it in some tier. An answer that is not a success, or not of that shape,
    raises."""
    body = _DECODE(raw)
    if not body.success:
        raise RuntimeError(f"batch_query_keys answered {raw[:200]!r}")
    return {k: bool(v.ok and (v.values or v.disk_values or v.local_disk_values))
            for k, v in (body.data or {}).items()}


class UrlTooLong(RuntimeError):
    """Something on the way to the admin port refused the query's URL as too long (HTTP 414
    or 431): a proxy's limit; the master itself takes them at 100 KB and more."""


class MasterKeys:
    """Which keys the master holds a complete replica of (memory or disk), from its HTTP admin
    port's /batch_query_keys (grants no lease), over one kept-alive connection. Raises on any
    failure (and reconnects on the next query)."""

    def __init__(self, master_http: str, timeout: float = 5.0) -> None:
        self.address = master_http
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
            if resp.status in (414, 431):
                raise UrlTooLong(f"batch_query_keys answered HTTP {resp.status} to "
                                 f"{len(keys)} keys")
            if resp.status != 200:
                raise RuntimeError(f"batch_query_keys answered HTTP {resp.status}")
        except Exception:
            self.close()
            raise
        return held(raw)

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
