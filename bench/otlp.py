"""SDK-side helpers for the instrumentation-cost runs: a tracer provider whose exports are
counted, so the report can show the spans really left the process (to the devkit's rotel
collector, through the same OTLP/HTTP exporter and BatchSpanProcessor a deployment uses).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


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
