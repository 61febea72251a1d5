"""A lean OTLP/HTTP (protobuf) trace exporter for the connector's fixed-shape spans.

Why not the SDK's: building five spans with the OpenTelemetry SDK and encoding them with its
OTLP encoder costs far more CPU per load job in Python (tracer bookkeeping, then one protobuf
object per attribute), a visible share of a CPU-bound loader's throughput at sampling 1.0. The
connector's spans always have the same shape, so they are written straight to protobuf wire
format here (field numbers from opentelemetry-proto `trace/v1/trace.proto`, a stable format;
tests decode the bytes with the official generated classes). Both costs per load job, measured:
docs/benchmark.md (rendered from docs/benchmark.json).

Configuration follows the OTLP exporter spec: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS,
_TIMEOUT (milliseconds), _COMPRESSION (gzip) and _CERTIFICATE; resource attributes come from the
SDK's `Resource.create` (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES).
"""

from __future__ import annotations

import gzip
import logging
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote

logger = logging.getLogger(f"vllm.{__name__}")

_PACK_U64 = struct.Struct("<Q").pack
_PACK_F64 = struct.Struct("<d").pack
KIND_INTERNAL = b"\x30\x01"  # Span.kind = SPAN_KIND_INTERNAL
STATUS_ERROR = 2


_SMALL = tuple(bytes((i,)) for i in range(128))


def _varint(n: int) -> bytes:
    if 0 <= n < 128:  # most tags, lengths and attribute values
        return _SMALL[n]
    n &= (1 << 64) - 1  # negative int64 values are 10-byte two's complement varints
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(tag << 3 | 2) + _varint(len(payload)) + payload


def _any_value(v: Any) -> bytes:
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + _varint(v)
    if isinstance(v, float):
        return b"\x21" + _PACK_F64(v)
    return _field(1, str(v).encode())


_KEYS: dict[str, bytes] = {}  # attribute key -> its encoded field (a handful of fixed keys)


def key_value(key: str, value: Any) -> bytes:
    k = _KEYS.get(key)
    if k is None:
        k = _KEYS[key] = _field(1, key.encode())
    v = _any_value(value)
    return k + b"\x12" + _varint(len(v)) + v


def attributes(attrs: Mapping[str, Any], tag: int) -> bytes:
    """`repeated KeyValue` at field `tag` (Span: 9, Resource: 1)."""
    t = _varint(tag << 3 | 2)
    out = []
    for k, v in attrs.items():
        kv = key_value(k, v)
        out.append(t + _varint(len(kv)) + kv)
    return b"".join(out)


def span(trace_id: bytes, span_id: bytes, parent_id: bytes, name: bytes, start_ns: int,
         end_ns: int, attrs: bytes = b"", error: str = "") -> bytes:
    """One encoded `Span` message; `name` and `attrs` pre-encoded (see `name_field`,
    `attributes`), `parent_id` empty for a root."""
    out = b"\x0a\x10" + trace_id + b"\x12\x08" + span_id
    if parent_id:
        out += b"\x22\x08" + parent_id
    out += name + KIND_INTERNAL + b"\x39" + _PACK_U64(start_ns) + b"\x41" + _PACK_U64(end_ns)
    out += attrs
    if error:  # Status{message = 2, code = 3}
        out += _field(15, _field(2, error.encode()) + b"\x18" + _varint(STATUS_ERROR))
    return _field(2, out)  # as an entry of ScopeSpans.spans


_NAMES: dict[str, bytes] = {}  # span name -> its encoded field (a handful of fixed names)


def name_field(name: str) -> bytes:
    enc = _NAMES.get(name)
    if enc is None:
        enc = _NAMES[name] = _field(5, name.encode())
    return enc


def request(resource: bytes, scope_name: str, spans: Sequence[bytes]) -> bytes:
    """ExportTraceServiceRequest{resource_spans: [ResourceSpans{resource, scope_spans: [
    ScopeSpans{scope, spans}]}]}; `resource` is an encoded Resource's attribute fields."""
    scope_spans = _field(1, _field(1, scope_name.encode())) + b"".join(spans)
    return _field(1, _field(1, resource) + _field(2, scope_spans))


def _env(environ: Mapping[str, str], name: str) -> str | None:
    return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or \
        environ.get(f"OTEL_EXPORTER_OTLP_{name}")


def endpoint_url(environ: Mapping[str, str] = os.environ) -> str:
    """The traces URL: the signal-specific endpoint as is, the generic one + /v1/traces."""
    url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if url:
        return url
    return environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318").rstrip("/") + \
        "/v1/traces"


def parse_headers(value: str | None) -> dict[str, str]:
    """`k1=v1,k2=v2` with URL-encoded values, as the OTLP exporter spec defines."""
    out = {}
    for item in (value or "").split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            out[k.strip()] = unquote(v.strip())
        elif item.strip():
            logger.warning("ignoring malformed OTLP header %r (expected key=value)", item)
    return out


class OtlpHttpExporter:
    """Posts encoded span batches to an OTLP/HTTP collector (from the trace thread only)."""

    def __init__(self, resource_attrs: Mapping[str, Any],
                 environ: Mapping[str, str] = os.environ) -> None:
        import requests
        from opentelemetry.sdk.resources import Resource

        self.url = endpoint_url(environ)
        self._timeout = float(_env(environ, "TIMEOUT") or 10_000) / 1000
        self._gzip = (_env(environ, "COMPRESSION") or "").lower() == "gzip"
        self._session = requests.Session()
        self._session.headers.update({"Content-Type": "application/x-protobuf",
                                      **parse_headers(_env(environ, "HEADERS"))})
        if self._gzip:
            self._session.headers["Content-Encoding"] = "gzip"
        self._session.verify = _env(environ, "CERTIFICATE") or True
        self.resource = attributes(dict(Resource.create(dict(resource_attrs)).attributes), 1)
        self.exported = 0
        self.failed = 0

    def export(self, spans: Sequence[bytes], scope_name: str) -> bool:
        body = request(self.resource, scope_name, spans)
        try:
            r = self._session.post(self.url, data=gzip.compress(body) if self._gzip else body,
                                   timeout=self._timeout)
            ok = 200 <= r.status_code < 300
            detail = f"HTTP {r.status_code}"
        except Exception as e:  # the collector being down must never reach the data path
            ok, detail = False, repr(e)
        if ok:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
            if self.failed == len(spans) or self.failed % 10_000 < len(spans):
                logger.warning("OTLP export to %s failed (%s); %d spans lost so far", self.url,
                               detail, self.failed)
        return ok

    def shutdown(self) -> None:
        self._session.close()
