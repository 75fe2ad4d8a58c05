"""A forward that raises part-way (after some layers already appended KV) leaves the row / batch
KV exactly as it was, so the scheduler can fail one request or retry without corrupting others."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gemmaserve_hf_torch.backend import HFTorchBackend


class _FailOnce:
    def __init__(self) -> None:
        self.armed = True

    def __call__(self, original: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.armed = False
                raise RuntimeError("simulated device failure in the last layer")
            return original(*args, **kwargs)

        return forward


def test_failed_forwards_leave_kv_unchanged(llama_backend: HFTorchBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = llama_backend
    last_layer = backend.loaded.model.model.layers[-1]
    prompts = [list(range(20, 31)), list(range(40, 45))]
    with backend.lock:
        results = [backend.prefill(p) for p in prompts]
        batch = backend.stack_caches_left_padded([r.kv for r in results])
        fail = _FailOnce()
        monkeypatch.setattr(last_layer, "forward", fail(last_layer.forward))
        with pytest.raises(RuntimeError, match="simulated"):
            backend.decode_step_batched(batch, [7, 8])
        assert [backend.kv_length(batch, i) for i in range(2)] == [11, 5]
        backend.check_integrity()
        logits = backend.decode_step_batched(batch, [7, 8])  # the retry sees exactly the old KV
        for row, (prompt, token) in enumerate(zip(prompts, [7, 8])):
            with torch.inference_mode():
                solo = backend.loaded.model(input_ids=torch.tensor([[*prompt, token]]), use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits[row], solo, atol=1e-4, rtol=0)

        state = backend.prefill_lookup(list(range(60, 70)))
        backend.prefill_chunk(state, 4)
        fail.armed = True
        with pytest.raises(RuntimeError, match="simulated"):
            backend.prefill_chunk(state, 3)
        assert backend.kv_length(state.kv) == state.num_computed == 4
        backend.check_integrity()
        backend.prefill_chunk(state, 6)
        assert state.is_complete
        backend.free_row_kv(state.kv)
        for index in (1, 0):
            backend.remove_row_from_cache(batch, index)
