"""CUSTOM_BACKEND_COMPILE's fallback off CUDA graphs: a compiled forward that raises is retried eagerly and
replaced by the eager forward for good, with the reason kept."""

from __future__ import annotations

import torch

from gemmaserve_custom_torch.graphs import maybe_compile


def test_a_failing_compiled_forward_falls_back_to_eager_for_good():
    calls = {"compiled": 0, "eager": 0}

    def eager(key: int) -> tuple[torch.Tensor, ...]:
        calls["eager"] += 1
        return (torch.full((2,), float(key)),)

    def failing(key: int) -> tuple[torch.Tensor, ...]:
        calls["compiled"] += 1
        raise TypeError("launcher() missing 1 required positional argument: '_grid_2'")

    forward = maybe_compile(eager, True)
    forward.compiled = failing
    assert forward(3)[0].tolist() == [3.0, 3.0]
    assert forward(4)[0].tolist() == [4.0, 4.0]
    assert calls == {"compiled": 1, "eager": 2}
    assert forward.compiled is None and forward.error.startswith("TypeError: launcher()")
    assert maybe_compile(eager, False) is eager
