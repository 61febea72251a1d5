"""Sampling decisions of the observability subscribers, kept off the data path's code.

- `TraceSampler`: which jobs get spans, following the OpenTelemetry SDK sampler spec
  (OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG), and the trace id a sampled job's spans get.
  The ids are chosen here, when the job finishes, so the metrics can carry the same trace id as
  an exemplar before the trace thread builds the spans.
- `LookupProbe`: which load jobs time the master lookup separately (an extra master round trip):
  the first job on every thread, then one job in N, and also the first job after a quiet
  `interval_s`, so every thread that worked shows a lookup sample within a scrape interval even
  under light traffic.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level

DEFAULT_SAMPLER = "parentbased_traceidratio"
DEFAULT_SAMPLE_RATIO = 0.05  # the project's default when OTEL_TRACES_SAMPLER is unset
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")
_ID_LIMIT = 1 << 64  # TraceIdRatioBased compares the trace id's low 64 bits to ratio * 2^64


def _ratio_arg(environ: Mapping[str, str]) -> float:
    """OTEL_TRACES_SAMPLER_ARG for the ratio samplers; the spec's default is 1.0."""
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG")
    if arg is None or arg.strip() == "":
        return 1.0
    try:
        ratio = float(arg)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        logger.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a ratio in [0, 1]; using 1.0 (set "
                       "it to e.g. 0.05, or kv_connector_extra_config.trace_sample_ratio)", arg)
        return 1.0
    return ratio


class TraceSampler:
    """The OTel SDK samplers for the connector's job spans.

    A job's parent is the context captured when it was queued. vLLM has no active span on the
    worker's model-runner thread, so in practice every job is a root and the `parentbased_*`
    samplers behave as their root sampler (parentbased_always_on as always_on, and so on); a
    valid parent, where there is one, decides as the spec says (sampled parent: sample).
    """

    def __init__(self, name: str, ratio: float = 1.0) -> None:
        if name not in SAMPLERS:
            raise ValueError(f"unknown sampler {name!r}; one of {', '.join(SAMPLERS)}")
        self.name = name
        self.parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        self.ratio = {"always_on": 1.0, "always_off": 0.0}.get(root, ratio)
        self._bound = round(self.ratio * _ID_LIMIT)

    @classmethod
    def configured(cls, trace_sample_ratio: float | None,
                   environ: Mapping[str, str] = os.environ) -> TraceSampler:
        """`trace_sample_ratio` (parent-based ratio) overrides the OTEL_TRACES_SAMPLER[_ARG]
        variables; with neither, parentbased_traceidratio at DEFAULT_SAMPLE_RATIO."""
        if trace_sample_ratio is not None:
            return cls(DEFAULT_SAMPLER, trace_sample_ratio)
        name = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
        if not name:
            return cls(DEFAULT_SAMPLER, DEFAULT_SAMPLE_RATIO)
        if name not in SAMPLERS:
            logger.warning("OTEL_TRACES_SAMPLER=%r is not supported by the connector (one of "
                           "%s); using %s %s", name, ", ".join(SAMPLERS), DEFAULT_SAMPLER,
                           DEFAULT_SAMPLE_RATIO)
            return cls(DEFAULT_SAMPLER, DEFAULT_SAMPLE_RATIO)
        return cls(name, _ratio_arg(environ) if name.endswith("traceidratio") else 1.0)

    @property
    def never(self) -> bool:
        """True when no job can be sampled whatever its parent: tracing need not run at all."""
        return self.ratio == 0.0 and not self.parent_based

    def sample(self, parent: Any) -> tuple[bytes, bytes] | None:
        """(trace id, parent span id or b"") for a sampled job, None for a dropped one.
        `parent`: a span context (or None); with a valid one the job joins its trace."""
        trace_id, parent_id = None, b""
        if parent is not None and parent.is_valid:
            if self.parent_based:
                if not parent.trace_flags.sampled:
                    return None
                return parent.trace_id.to_bytes(16, "big"), parent.span_id.to_bytes(8, "big")
            trace_id = parent.trace_id
            parent_id = parent.span_id.to_bytes(8, "big")
        if self._bound == 0:
            return None
        if trace_id is None:
            trace_id = random.getrandbits(128) or 1
        if (trace_id & (_ID_LIMIT - 1)) >= self._bound:
            return None
        return trace_id.to_bytes(16, "big"), parent_id


class LookupProbe:
    """Which load jobs time their master lookup: per thread, the first job, then every
    `every`-th, and any job more than `interval_s` after that thread's last probe.

    Cost bound: at most ratio x jobs + threads / interval_s probes per second (one extra
    master round trip each). ratio 0 turns the probe off entirely."""

    def __init__(self, ratio: float, threads: int, interval_s: float = 5.0) -> None:
        self._every = round(1 / ratio) if ratio > 0 else 0
        self._interval = interval_s
        self._count = [0] * threads
        self._last = [float("-inf")] * threads  # monotonic time of each thread's last probe

    def due(self, thread: int) -> bool:
        """Called once per job by the thread that runs it (no lock: one writer per slot)."""
        if not self._every:
            return False
        n = self._count[thread]
        self._count[thread] = n + 1
        now = time.monotonic()
        if n % self._every == 0 or now - self._last[thread] >= self._interval:
            self._last[thread] = now
            return True
        return False
