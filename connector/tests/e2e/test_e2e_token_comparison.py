"""`assert_same_tokens` compares only runs computed along the same prefill steps (the module
docstring of _e2e says why: on CPUs with AMX the bf16 rounding follows the split). Shown here
without a server, on any CPU: a run whose prefill resumed off a step boundary (its split
differs from the cold run's) is refused before its tokens are compared, even when they agree;
runs along the same steps are compared, and a difference fails."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from _e2e import BATCH_BUDGET, CHUNK, assert_same_tokens


class _Resumed:
    """Counters of a request that resumed its prefill at ``tokens`` (vLLM's prefix cache and
    kvtier's loads together)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def resumed_at(self, ranks: int = 1) -> int:
        return self.tokens


def _run(tokens: list[int]) -> Any:
    return SimpleNamespace(token_ids=tokens)


def test_a_run_split_otherwise_than_the_cold_run_is_not_compared() -> None:
    same = [1, 2, 3]
    with pytest.raises(AssertionError, match="not comparable on every CPU"):
        assert_same_tokens(_run(same), _run(same), _Resumed(16 * CHUNK - 16))
    with pytest.raises(AssertionError, match="not comparable on every CPU"):
        assert_same_tokens(_run(same), _run(same), _Resumed(BATCH_BUDGET + 1))


def test_runs_along_the_same_steps_are_compared_token_by_token() -> None:
    assert_same_tokens(_run([1, 2, 3]), _run([1, 2, 3]), _Resumed(16 * CHUNK))
    assert_same_tokens(_run([1, 2, 3]), _run([1, 2, 3]), _Resumed(0))
    with pytest.raises(AssertionError, match="differ from the reference's at output token 2"):
        assert_same_tokens(_run([1, 2, 4]), _run([1, 2, 3]), _Resumed(16 * CHUNK))
