"""Helpers for the custom_torch backend tests: backends over the session's tiny checkpoints, reference runs,
and a scheduler driver. Models and tokenizers are loaded once per path and shared (they are stateless)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from gemmaserve.engine.request import Request
from gemmaserve.engine.scheduler import ContinuousBatchScheduler
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings
from gemmaserve_custom_torch.backend import CustomTorchBackend
from gemmaserve_custom_torch.models import ContiguousKVContext, GemmaForCausalLM
from gemmaserve_custom_torch.settings import load_custom_settings
from gemmaserve_custom_torch.tokenizer import HFTokenizer

SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Import into a test module to run its tests on one intra-op thread: tiny shapes gain nothing from
    more, and lose several-fold when the CPU is shared (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def _load(path: Path) -> tuple[GemmaForCausalLM, HFTokenizer]:
    return GemmaForCausalLM.from_hf(path, "cpu", torch.float32), HFTokenizer.from_pretrained(path)


def make_backend(
    path: Path,
    *,
    block_size: int = 4,
    kv_blocks: int | None = 96,
    max_batch_size: int = 8,
    max_active_kv_tokens: int = 100_000,
    prefill_chunk_tokens: int = 16,
    **custom: Any,
) -> CustomTorchBackend:
    """A fresh backend (own pools and prefix cache) over the shared fp32 CPU model of ``path``."""
    path = Path(path)
    model, tokenizer = _load(path)
    core = CoreSettings(
        model=str(path), device="cpu", dtype="float32", kv_block_size=block_size, max_batch_size=max_batch_size,
        max_active_kv_tokens=max_active_kv_tokens, prefill_chunk_tokens=prefill_chunk_tokens,
    )
    custom_settings = load_custom_settings(kv_blocks=kv_blocks, **custom)
    return CustomTorchBackend(model, tokenizer, core, custom_settings, name=path.name)


def contiguous_greedy(model: GemmaForCausalLM, prompt: Sequence[int], num_tokens: int) -> list[int]:
    """Greedy tokens from the unpaged reference context (prefill, then one token per step)."""
    ctx = ContiguousKVContext(model.config)
    ids = torch.tensor([list(prompt)])
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(ids, ctx.next_positions(1, ids.shape[1]), ctx, logits_to_keep=1)
            tokens.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


def assert_matches_hf_generate(hf_model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> None:
    """``tokens`` (greedy, EOS not special) equal transformers' greedy ``generate``, which may stop at EOS."""
    out = hf_model.generate(torch.tensor([list(prompt)]), max_new_tokens=len(tokens), do_sample=False)
    ref = out[0, len(prompt):].tolist()
    assert list(tokens[: len(ref)]) == ref, (list(tokens), ref)
    eos = hf_model.generation_config.eos_token_id
    assert len(ref) == len(tokens) or ref[-1] in (eos if isinstance(eos, list) else [eos])


def assert_no_leaks(backend: CustomTorchBackend) -> None:
    """Integrity holds, no row is alive, and every used block is held by the prefix cache alone."""
    backend.check_integrity()
    assert not backend.pools.live_rows, f"{len(backend.pools.live_rows)} rows were never freed"
    refs = backend.prefix_cache.references()
    for group, manager in backend.pools.managers.items():
        assert manager.num_used == len(refs[group]), f"{group}: used blocks not all held by the prefix cache"


def run_scheduler(
    backend: CustomTorchBackend,
    requests: Sequence[tuple[Sequence[int], int, int]],
    *,
    max_batch_size: int = 8,
    prefill_chunk_tokens: int = 16,
    max_active_kv_tokens: int = 100_000,
    max_num_batched_tokens: int = 8192,
    check_every_tick: bool = True,
    async_scheduling: bool = True,
) -> dict[str, Request]:
    """Drive ContinuousBatchScheduler to completion. ``requests``: (prompt, arrival tick, max_tokens),
    greedy, ignore_eos. Returns the finished requests by id ("r0", "r1", ...)."""
    settings = CoreSettings(max_batch_size=max_batch_size, prefill_chunk_tokens=prefill_chunk_tokens,
                            max_active_kv_tokens=max_active_kv_tokens, max_num_batched_tokens=max_num_batched_tokens,
                            async_scheduling=async_scheduling)
    sched = ContinuousBatchScheduler(backend, settings)
    made = {f"r{i}": Request(f"r{i}", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, _, n) in enumerate(requests)}
    arrivals = {f"r{i}": tick for i, (_, tick, _) in enumerate(requests)}
    tick = 0
    while tick <= max(arrivals.values(), default=0) or sched.has_work:
        for rid, request in made.items():
            if arrivals[rid] == tick:
                sched.add_request(request)
        sched.step()
        if check_every_tick:
            sched.check_integrity()
            backend.check_integrity()
        tick += 1
        assert tick < 10_000, "scheduler did not finish"
    return made
