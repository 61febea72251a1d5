"""The suite's exactness check cannot be applied to outputs that depend on the CPU: engines run
float32 by default, and completions of an engine in any other dtype refuse to be compared."""

from __future__ import annotations

import os

import pytest

from devkit.vllm_server import EXACT_DTYPE, Completion, InexactComparison, VllmServer


def test_completions_of_float32_engines_compare_as_token_lists():
    a, b = Completion([5, 7], EXACT_DTYPE), Completion([5, 7], EXACT_DTYPE)
    assert a == b and [a, b] == [b, a] and not a != b
    assert a != Completion([5, 8], EXACT_DTYPE) and [a] != [Completion([5], EXACT_DTYPE)]
    assert a == [5, 7] and [5, 7] == a and a != [7, 5]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "auto"])
def test_completions_of_other_dtypes_refuse_every_comparison(dtype):
    other, exact = Completion([5, 7], dtype), Completion([5, 7], EXACT_DTYPE)
    comparisons = [lambda: other == exact, lambda: exact == other, lambda: other != exact,
                   lambda: [exact, exact] == [exact, other], lambda: [5, 7] == other,
                   lambda: other == Completion([5, 7], dtype)]
    for compare in comparisons:
        with pytest.raises(InexactComparison, match=f"outputs of a {dtype} engine"):
            compare()


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_engines_run_float32_unless_told(dtype):
    server = VllmServer("m") if dtype is None else VllmServer("m", dtype=dtype)
    os.unlink(server.log_path)
    cmd = server.command()
    assert cmd[cmd.index("--dtype") + 1] == (dtype or EXACT_DTYPE) == server.dtype
