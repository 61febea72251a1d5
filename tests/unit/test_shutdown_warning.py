"""The startup warning for vLLM's default `--shutdown-timeout` of 0, at which vLLM 0.32 kills
EngineCore and its workers right after SIGTERM (v1/utils.py::shutdown: terminate, then kill past
a 0 s deadline), so the connector's shutdown is cut short and queued saves are lost."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs

from connector.worker.worker import SHUTDOWN_BOUND_S, shutdown_timeout_warning


def test_vllm_still_defaults_to_no_shutdown_timeout():
    """The warning exists because of this default: if vLLM changes it, revisit the warning."""
    field = next(f for f in dataclasses.fields(VllmConfig) if f.name == "shutdown_timeout")
    assert getattr(field.default, "default", field.default) == 0
    assert EngineArgs.shutdown_timeout == 0


def test_an_engine_that_saves_is_warned_about_a_zero_shutdown_timeout():
    note = shutdown_timeout_warning(SimpleNamespace(shutdown_timeout=0), saves=True)
    assert note and "--shutdown-timeout" in note and "at once" in note
    assert "--shutdown-timeout 30" in note  # the fix
    # Too short for the connector's own bound too.
    assert shutdown_timeout_warning(SimpleNamespace(shutdown_timeout=1), saves=True)
    assert shutdown_timeout_warning(SimpleNamespace(shutdown_timeout=int(SHUTDOWN_BOUND_S) + 1),
                                    saves=True) is None
    assert shutdown_timeout_warning(SimpleNamespace(shutdown_timeout=0), saves=False) is None
