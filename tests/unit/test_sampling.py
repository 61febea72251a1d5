"""The OTel sampler spec as the connector applies it (OTEL_TRACES_SAMPLER[_ARG], the
trace_sample_ratio override, parent-based decisions, trace-id ratio), and the master-lookup
probe: first job on every thread, then by ratio and by time, with a bounded cost."""

from __future__ import annotations

import logging
import random

import pytest
from opentelemetry.trace import SpanContext, TraceFlags

from connector.observability import sampling
from connector.observability.sampling import (
    DEFAULT_SAMPLE_RATIO,
    SAMPLERS,
    LookupProbe,
    TraceSampler,
)


def env(name: str | None = None, arg: str | None = None) -> dict[str, str]:
    out = {}
    if name is not None:
        out["OTEL_TRACES_SAMPLER"] = name
    if arg is not None:
        out["OTEL_TRACES_SAMPLER_ARG"] = arg
    return out


def parent(sampled: bool, trace_id: int | None = None) -> SpanContext:
    return SpanContext(trace_id or random.getrandbits(128) or 1, 0xABCDEF, is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else 0))


def share(s: TraceSampler, n: int = 4000, p=None) -> float:
    return sum(s.sample(p) is not None for _ in range(n)) / n


@pytest.mark.parametrize(("name", "arg", "ratio", "parent_based"), [
    (None, None, DEFAULT_SAMPLE_RATIO, True),  # unset: the project's documented default
    ("always_on", None, 1.0, False),
    ("always_off", None, 0.0, False),
    ("traceidratio", "0.25", 0.25, False),
    ("traceidratio", None, 1.0, False),  # the spec's default argument
    ("parentbased_always_on", "0.3", 1.0, True),  # the argument only applies to ratio samplers
    ("parentbased_always_off", None, 0.0, True),
    ("parentbased_traceidratio", "0.5", 0.5, True),
    ("PARENTBASED_TRACEIDRATIO", "0.5", 0.5, True),
])
def test_sampler_from_environment(name, arg, ratio, parent_based):
    s = TraceSampler.configured(None, env(name, arg))
    assert (s.ratio, s.parent_based) == (ratio, parent_based)
    assert s.name in SAMPLERS


def test_config_key_overrides_the_variables():
    s = TraceSampler.configured(0.2, env("always_off"))
    assert (s.name, s.ratio) == ("parentbased_traceidratio", 0.2)


@pytest.mark.parametrize(("name", "arg"), [("jaeger_remote", None), ("traceidratio", "lots"),
                                           ("traceidratio", "1.5")])
def test_bad_values_warn_and_fall_back(name, arg, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.connector.observability.sampling"):
        s = TraceSampler.configured(None, env(name, arg))
    assert caplog.records, "a bad value must be reported"
    assert s.ratio == (DEFAULT_SAMPLE_RATIO if name == "jaeger_remote" else 1.0)


def test_root_decisions():
    assert share(TraceSampler("always_on")) == 1.0
    assert share(TraceSampler("parentbased_always_on")) == 1.0  # roots: like always_on
    assert share(TraceSampler("always_off")) == 0.0
    assert share(TraceSampler("parentbased_always_off")) == 0.0
    assert 0.2 < share(TraceSampler("traceidratio", 0.25)) < 0.3
    assert 0.2 < share(TraceSampler("parentbased_traceidratio", 0.25)) < 0.3
    trace_id, parent_id = TraceSampler("always_on").sample(None)
    assert len(trace_id) == 16 and trace_id != bytes(16) and parent_id == b""


def test_parent_decides_for_parent_based_samplers():
    on = parent(True)
    for name in ("parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio"):
        s = TraceSampler(name, 0.0)
        assert s.sample(on) == (on.trace_id.to_bytes(16, "big"), on.span_id.to_bytes(8, "big"))
        assert s.sample(parent(False)) is None


def test_non_parent_based_samplers_ignore_the_parent_flag():
    off = parent(False)
    assert TraceSampler("always_on").sample(off)[0] == off.trace_id.to_bytes(16, "big")
    assert TraceSampler("always_off").sample(parent(True)) is None
    # traceidratio decides on the trace id's low 64 bits: the same trace, the same decision.
    s = TraceSampler("traceidratio", 0.5)
    low, high = parent(False, (7 << 64) | 1), parent(False, (7 << 64) | (2**64 - 1))
    assert s.sample(low) is not None and s.sample(high) is None


def test_never_means_nothing_can_be_sampled():
    assert TraceSampler("always_off").never and TraceSampler("traceidratio", 0.0).never
    assert not TraceSampler("parentbased_always_off").never  # a sampled parent still counts
    assert not TraceSampler("always_on").never


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(sampling.time, "monotonic", c)
    return c


def test_probe_measures_the_first_job_on_every_thread(clock):
    probe = LookupProbe(0.1, threads=4)
    assert [probe.due(t) for t in range(4)] == [True] * 4
    assert [probe.due(0) for _ in range(9)] == [False] * 9
    assert probe.due(0)  # then one job in ten


def test_probe_measures_a_quiet_thread_again_after_the_interval(clock):
    probe = LookupProbe(0.1, threads=2, interval_s=5.0)
    assert probe.due(1)
    clock.t += 4.9
    assert not probe.due(1)
    clock.t += 0.2
    assert probe.due(1)  # light traffic: a sample every interval, not every tenth job
    assert not probe.due(1)


def test_probe_cost_is_bounded_and_ratio_zero_is_off(clock):
    probe = LookupProbe(0.1, threads=1, interval_s=5.0)
    due = 0
    for _ in range(10_000):  # 10 s of 1000 jobs/s
        due += probe.due(0)
        clock.t += 0.001
    assert 1000 <= due <= 1000 + 10 / 5 + 1
    off = LookupProbe(0.0, threads=1)
    assert not any(off.due(0) for _ in range(100))
