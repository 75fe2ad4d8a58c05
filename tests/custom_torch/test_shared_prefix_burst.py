"""A burst of prompts sharing a long prefix on custom_torch, whose prefix cache finds a chunk's blocks as soon as
it is computed (``progressive_cache_block_size``): the shared prefix is computed once (the followers wait for the
leader's blocks, engine/shared_prefix.py) and every request's greedy tokens stay transformers'."""

from __future__ import annotations

import pytest
import torch

from fixtures_backend import assert_matches_hf_generate, assert_no_leaks, make_backend, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.engine.request import FinishReason


@pytest.mark.parametrize("name", ["gemma4", "gemma3"])
def test_a_burst_sharing_a_prefix_computes_it_once(tiny_checkpoint, hf_reference, name, monkeypatch):
    path = tiny_checkpoint(name)
    prefix = [(5 * i) % 300 + 4 for i in range(40)]
    requests = [(prefix + [(11 * i + j) % 300 + 4 for j in range(3)], 0, 4) for i in range(6)]
    computed = {}
    for waits in (False, True):
        if not waits:  # the same scheduler with the rule switched off, for the comparison
            monkeypatch.setattr("gemmaserve.engine.scheduler.should_wait", lambda *a, **k: False)
        else:
            monkeypatch.undo()
        backend = make_backend(path, block_size=4, kv_blocks=400)
        assert backend.capabilities.progressive_cache_block_size == 4
        done = run_scheduler(backend, requests, max_batch_size=6, prefill_chunk_tokens=8, max_num_batched_tokens=64)
        computed[waits] = sum(len(r.prompt_token_ids) - r.cached_tokens for r in done.values())
        hf = hf_reference(path, torch.float32)
        for rid, (prompt, _, _) in zip(sorted(done, key=lambda r: int(r[1:])), requests):
            assert done[rid].finish_reason is FinishReason.LENGTH, (rid, done[rid].error)
            assert_matches_hf_generate(hf, prompt, done[rid].output_token_ids)
        assert_no_leaks(backend)
    assert computed[False] >= 6 * 43 - 6 * 8  # without waiting, the burst's first chunks all miss
    assert computed[True] <= 43 + 5 * 4, computed  # the prefix once, then each prompt's own tokens (+ block rest)
