"""A real OTLP collector (`rotel`, from PyPI) on free loopback ports, and a parser for the spans
it prints with `--debug-log traces --debug-log-verbosity detailed`. The tests read those spans;
the benchmark turns printing off (`print_spans=False`), so the receiver costs it little CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from devkit.local_cluster import free_port
from devkit.processes import HOST, spawn, stop_process, wait_port

_ATTR = re.compile(r"^\s+-> ([\w.]+): \w+\((.*)\)$")


def _binary() -> str:
    import rotel

    return str(Path(rotel.__file__).parent / "rotel-agent")


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, str] = field(default_factory=dict)
    resource: dict[str, str] = field(default_factory=dict)


def parse_spans(text: str) -> list[Span]:
    spans: list[Span] = []
    resource: dict[str, str] = {}
    cur: Span | None = None
    section = ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("ResourceSpans #"):
            resource, section = {}, "resource"
        elif s.startswith("Span #"):
            cur = Span("", "", "", "", 0, 0, "", resource=resource)
            spans.append(cur)
            section = "span"
        elif s == "Attributes:":
            section = "attrs"
        elif (m := _ATTR.match(line)) and section in ("resource", "attrs"):
            target = resource if section == "resource" else cur.attributes
            target[m.group(1)] = m.group(2)
        elif cur is not None and ":" in s:
            key, _, value = (p.strip() for p in s.partition(":"))
            if key == "Trace ID":
                cur.trace_id = value
            elif key == "Parent ID":
                cur.parent_id = value
            elif key == "ID":
                cur.span_id = value
            elif key == "Name":
                cur.name = value
            elif key == "Start time":
                cur.start_ns = int(value)
            elif key == "End time":
                cur.end_ns = int(value)
            elif key == "Status code":
                cur.status = value
    return spans


@dataclass
class RotelCollector:
    print_spans: bool = True
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rotel-"))
    proc: subprocess.Popen | None = None

    @property
    def traces_endpoint(self) -> str:
        return f"http://{HOST}:{self.http_port}/v1/traces"

    @property
    def output(self) -> Path:
        return Path(self.workdir) / "stdout.log"

    def otel_env(self, sample_ratio: float = 1.0) -> dict[str, str]:
        """Standard OTEL_* variables that point an exporter at this collector."""
        return {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.traces_endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(sample_ratio),
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }

    @property
    def kind(self) -> str:
        return "rotel-agent (blackhole exporter)"

    def start(self) -> RotelCollector:
        debug = ["--debug-log", "traces", "--debug-log-verbosity", "detailed"] \
            if self.print_spans else []
        self.proc = spawn(
            [_binary(), "start", "--otlp-http-endpoint", f"{HOST}:{self.http_port}",
             "--otlp-grpc-endpoint", f"{HOST}:{self.grpc_port}", "--exporter", "blackhole",
             *debug, "--pid-file", os.path.join(self.workdir, "rotel.pid"),
             "--log-file", os.path.join(self.workdir, "rotel.log")], self.output)
        wait_port(self.http_port, self.proc, "rotel")
        return self

    def spans(self) -> list[Span]:
        return parse_spans(self.output.read_text(errors="replace"))

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
