"""GPU: the one-forward tick on CUDA (Triton ragged attention, fixed buffers, one CUDA graph per token bucket)
against the same tick run eagerly, and greedy parity with the portable path, on an E2B-like tiny geometry."""

from __future__ import annotations

import torch

from fixtures_backend import run_scheduler
from test_cuda_graphs import cuda_backend, e2b_like_dir, joining_requests, pytestmark  # noqa: F401


def test_graph_ticks_equal_eager_ticks_fp32(e2b_like_dir):
    """fp32: replaying the bucket graphs gives the eager (unpadded, no-graph) ticks' greedy tokens exactly,
    with joins, leaves, chunked prompts past the window and a small token budget."""
    requests = joining_requests(3, count=8)
    graphs = cuda_backend(e2b_like_dir, torch.float32)
    eager = cuda_backend(e2b_like_dir, torch.float32, cuda_graph=False)
    assert graphs.mixed.graphs is not None and eager.mixed.buffers is None
    kwargs = dict(max_batch_size=8, prefill_chunk_tokens=16, max_num_batched_tokens=40)
    got = [{r: q.output_token_ids for r, q in run_scheduler(b, requests, **kwargs).items()} for b in (graphs, eager)]
    assert got[0] == got[1]
    assert graphs.mixed.steps > 0 and graphs.mixed.eager_steps == 0 and len(graphs.mixed.graphs.capture_seconds) > 1
    for backend in (graphs, eager):
        backend.check_integrity()
        assert not backend.pools.live_rows


def test_fast_prefill_on_cuda_keeps_the_tokens_fp32(e2b_like_dir):
    requests = joining_requests(5, count=6)
    fast = cuda_backend(e2b_like_dir, torch.float32)
    full = cuda_backend(e2b_like_dir, torch.float32, fast_prefill=False)
    kwargs = dict(max_batch_size=8, prefill_chunk_tokens=32, max_num_batched_tokens=64)
    got = [{r: q.output_token_ids for r, q in run_scheduler(b, requests, **kwargs).items()} for b in (fast, full)]
    assert got[0] == got[1]
    assert fast.mixed.narrow_layer is not None and full.mixed.narrow_layer is None
