"""A real local OTLP receiver for the instrumentation-cost runs, and an SDK tracer provider
whose exports are counted, so the report can show the spans really left the process.

The receiver is `rotel-agent` (from the `rotel` wheel; a Rust OTLP collector, exporter
`blackhole`) in its own process. Without rotel, a stdlib HTTP sink in a child process accepts
OTLP/HTTP posts and answers 200. Either way the spans go through the same OTLP/HTTP exporter
and BatchSpanProcessor a deployment uses.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.local_cluster import free_port
from devkit.processes import HOST, spawn, stop_process, wait_port

_SINK = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def rotel_binary() -> str | None:
    try:
        import rotel
    except ImportError:
        return None
    path = Path(rotel.__file__).parent / "rotel-agent"
    return str(path) if path.exists() else None


@dataclass
class OtlpReceiver:
    """An OTLP/HTTP endpoint on loopback (rotel blackhole, else a stdlib sink)."""

    http_port: int = field(default_factory=free_port)
    kind: str = ""
    proc: subprocess.Popen | None = None

    @property
    def traces_endpoint(self) -> str:
        return f"http://{HOST}:{self.http_port}/v1/traces"

    def start(self) -> OtlpReceiver:
        d = tempfile.mkdtemp(prefix="bench-otlp-")
        binary = rotel_binary()
        if binary:
            cmd = [binary, "start", "--otlp-http-endpoint", f"{HOST}:{self.http_port}",
                   "--otlp-grpc-endpoint", f"{HOST}:{free_port()}", "--exporter", "blackhole",
                   "--pid-file", f"{d}/rotel.pid", "--log-file", f"{d}/rotel.log"]
            self.kind = "rotel-agent (blackhole exporter)"
        else:
            cmd = [sys.executable, "-c", _SINK, str(self.http_port)]
            self.kind = "stdlib http.server sink"
        self.proc = spawn(cmd, Path(d) / "stdout.log")
        try:
            wait_port(self.http_port, self.proc, f"OTLP receiver ({self.kind})")
        except (RuntimeError, TimeoutError):
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


class CountingExporter:
    """Wraps the OTLP exporter and counts spans it exported successfully (export thread only,
    so the data path pays nothing for the count)."""

    def __init__(self, inner: Any) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._inner = inner
        self._ok = SpanExportResult.SUCCESS
        self._lock = threading.Lock()
        self.exported = 0
        self.failed = 0

    def export(self, spans: Sequence[Any]) -> Any:
        result = self._inner.export(spans)
        with self._lock:
            if result == self._ok:
                self.exported += len(spans)
            else:
                self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def counting_provider(counter: CountingExporter) -> Any:
    """An SDK TracerProvider exporting through `counter` (the connector's SdkWriter path, as
    when vLLM set up a provider in the worker process)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "mcpool-bench"}))
    provider.add_span_processor(BatchSpanProcessor(counter))
    return provider
