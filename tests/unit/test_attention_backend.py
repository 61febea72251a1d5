"""Which attention backend each test model's engine gets, on this CPU.

vLLM's CPU platform chooses the backend by the CPU: an MLA model gets AMX_MLA on a CPU with AMX
tiles, which refuses float32 weights, so the suite's float32 MLA engine did not start on such
a CPU (and did elsewhere). Engines pin the backend (`devkit.vllm_server.attention_backend`); this
check resolves each pin the way `vllm serve` does here, so the next CPU difference fails with
the backend and its constraint named, not as an engine that does not start.
"""

from __future__ import annotations

import pytest

from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import (
    EXACT_DTYPE,
    MLA_BACKEND,
    VllmServer,
    backend_problem,
    cpu_backend_choice,
    uses_mla,
)
from tests.e2e.test_cross_tp import MODELS

KINDS = {"llama": lambda d: make_tiny_llama(d), **MODELS}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return {kind: str(make(tmp_path_factory.mktemp(kind))) for kind, make in KINDS.items()}


def pinned(server: VllmServer) -> str:
    cmd = server.command()
    assert "--attention-backend" in cmd, f"no attention backend pinned: {cmd}"
    return cmd[cmd.index("--attention-backend") + 1]


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_test_model_gets_a_backend_that_serves_float32_on_this_cpu(kind, models):
    server = VllmServer(models[kind])
    mla = uses_mla(server.model)
    backend = pinned(server)
    got = cpu_backend_choice(mla, backend)
    print(f"{kind}: pinned {backend}, runs {got} (unpinned, vLLM would choose "
          f"{cpu_backend_choice(mla, None)} on this CPU)")
    assert got == backend, f"{kind}: vLLM on this CPU runs {got}, not the pinned {backend}"
    assert backend_problem(got, server.dtype, mla) is None, backend_problem(got, server.dtype,
                                                                            mla)


def test_mla_model_is_recognised(models):
    assert [k for k in KINDS if uses_mla(models[k])] == ["mla"]
    assert pinned(VllmServer(models["mla"])) == MLA_BACKEND


def test_a_backend_that_refuses_float32_is_named():
    """What an unpinned MLA engine runs on an AMX CPU: the check names backend and dtype."""
    problem = backend_problem("AMX_MLA", EXACT_DTYPE, True)
    assert problem is not None and "AMX_MLA" in problem and EXACT_DTYPE in problem
    assert "MLA" in backend_problem("CPU_ATTN", EXACT_DTYPE, True)
