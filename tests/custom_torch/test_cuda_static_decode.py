"""CPU tests of the CUDA fast path's device-independent logic: graph buckets, the decode-only staging of the
fixed tick buffers (`DecodeStaging`), decode-only `MixedStep` ticks on the fixed buffers driven eagerly with
the plain-torch decode kernel, the decode fast-path predicate, settings, projection fusion and SDPA prefill
(fp32 on CPU)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from fixtures_backend import SLIDING, assert_no_leaks, make_backend, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.engine.request import FinishReason, Request
from gemmaserve.engine.scheduler import ContinuousBatchScheduler
from gemmaserve.sampling_params import RowSampling, SamplingParams
from gemmaserve.settings import CoreSettings
from gemmaserve.testing.backend_contract import BackendContractTests
from gemmaserve.testing.row_driver import solo_greedy
from gemmaserve_custom_torch.kernels import paged_decode_attention_reference
from gemmaserve_custom_torch.kv import PagedKVCache
from gemmaserve_custom_torch.kv.decode_state import DecodeStaging, graph_buckets, pick_bucket
from gemmaserve_custom_torch.mixed_step import MixedStep
from gemmaserve_custom_torch.models import GemmaForCausalLM
from gemmaserve_custom_torch.models.fusion import fuse_projections, is_fused
from gemmaserve_custom_torch.sampling import sample_tokens
from gemmaserve_custom_torch.settings import load_custom_settings, resolve_fast_paths


def with_fixed_decode(backend, max_batch_size: int = 8, fixed_buffers: bool = True):
    """Swap ``backend``'s ticks onto a `MixedStep` whose decode-only ticks run the plain-torch decode kernel
    (``paged_decode_attention_reference``, the Triton kernel's contract) on the padded fixed buffers the CUDA
    graphs replay (eagerly; ``fixed_buffers=False``: unpadded eager batches), which makes it an
    ``async_decode`` backend, as on CUDA. Ticks with prompt tokens use the ragged reference."""
    width = -(-backend.model_info.max_model_len // backend.block_size)
    backend.mixed = MixedStep(backend.model, backend.pools, "reference", fixed_buffers=fixed_buffers,
                              max_tokens=8192, max_seqs=max_batch_size, width=width,
                              decode_kernel=paged_decode_attention_reference)
    backend.async_decode = True
    backend.capabilities = dataclasses.replace(backend.capabilities, async_decode=True)
    return backend


def test_graph_buckets_and_pick():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(6) == (1, 2, 4, 6)
    assert graph_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    buckets = graph_buckets(48)
    assert [pick_bucket(buckets, n) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        pick_bucket(buckets, 49)
    with pytest.raises(ValueError):
        graph_buckets(0)


def _rows_of(backend, prompts):
    with backend.lock:
        return [backend.prefill(p).kv for p in prompts]


def test_decode_state_copies_changed_rows_only_and_pads_with_scratch(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir, block_size=4)
    pools = backend.pools
    rows = _rows_of(backend, [[5, 6, 7, 8, 9], [(3 * i) % 400 + 4 for i in range(14)]])
    groups = len(pools.groups)
    state = DecodeStaging(pools, torch.zeros(12, dtype=torch.int64), torch.full((groups, 4, 8), -1, dtype=torch.int32),
                          capacity=4, width=8)
    for row in rows:
        row.prepare_append(1)
    state.load(rows, [11, 12], bucket=4)
    assert state.rows_copied == 4  # nothing known yet: the two real rows and two padding rows [scratch, ...]
    assert state.io(4)[0].tolist() == [11, 12, 0, 0] and state.io(4)[1].tolist() == [5, 14, 0, 0]
    state.check_integrity(rows)
    ids, positions, seq_lens, tables, slots = state.step_tensors(4)
    assert seq_lens.tolist() == [6, 15, 1, 1]
    for group, table in tables.items():
        scratch = pools.scratch_block(group)
        assert table[2:, 0].tolist() == [scratch, scratch] and bool((table[2:, 1:] == -1).all())
        assert slots[group][2:].tolist() == [scratch * 4, scratch * 4]
        for i, row in enumerate(rows):
            assert int(slots[group][i]) == row.tables[group][row.length // 4] * 4 + row.length % 4
    state.load(rows, [11, 12], bucket=4)
    assert state.rows_copied == 4  # nothing changed: nothing copied
    rows[1].release_out_of_window(5)  # evicts sliding blocks: the row's version moves
    state.load(rows, [11, 12], bucket=2)
    assert state.rows_copied == 5
    state.load(rows[1:], [12], bucket=1)  # row 1 moves to slot 0: slot 0 is rewritten
    assert state.rows_copied == 6
    state.check_integrity(rows[1:])
    state.invalidate()  # a tick with prompt tokens rewrote the tables: the next load rewrites what it uses
    state.load(rows[1:], [12], bucket=1)
    assert state.rows_copied == 7
    state.check_integrity(rows[1:])
    with pytest.raises(ValueError, match="do not fit"):
        state.load(rows, [1, 2], bucket=1)
    too_narrow = DecodeStaging(pools, torch.zeros(6, dtype=torch.int64),
                               torch.full((groups, 2, 1), -1, dtype=torch.int32), capacity=2, width=1)
    with pytest.raises(ValueError, match="wide"):
        too_narrow.load(rows[1:], [1], bucket=1)
    for row in rows:
        row.free_all()
    pools.check_integrity()


def test_decode_needs_nothing_exactly_when_prepare_append_is_a_no_op(tiny_gemma4_dir):
    """Whenever the predicate says "nothing to do", prepare_append(1) changes no table; it says so on most
    steps. Covers a row whose blocks are shared with the prefix cache (copy-on-write pending)."""
    backend = make_backend(tiny_gemma4_dir, block_size=4)
    prompt = [(7 * i + 3) % 500 + 4 for i in range(10)]
    with backend.lock:
        rows = [backend.prefill(prompt).kv, backend.prefill(prompt).kv]  # prefill() stores: the second hits
        assert any(backend.pools.refcount(g, b) > 1 for g, t in rows[1].tables.items() for b in t if b >= 0)
        fast_steps = 0
        for row in rows:
            for _ in range(30):
                before = {g: list(t) for g, t in row.tables.items()}
                fast = row.decode_needs_nothing()
                row.prepare_append(1)
                if fast:
                    fast_steps += 1
                    assert {g: list(t) for g, t in row.tables.items()} == before, row.length
                row.commit_append(1)
            row.free_all()
        assert fast_steps >= 25  # 2 of every 4 positions at block size 4


@pytest.mark.parametrize("name", ["gemma4", "gemma4_k_eq_v", "gemma3"])
def test_fixed_buffer_decode_matches_gather_path_through_the_scheduler(tiny_checkpoint, name):
    """Joins and leaves at every tick, bucket sizes 1..8, block boundaries every 4 tokens, windows of 8."""
    path = tiny_checkpoint(name)
    rng = random.Random(7)
    requests = [([rng.randrange(4, 500) for _ in range(rng.randrange(1, 30))], rng.randrange(0, 12),
                 rng.randrange(1, 20)) for _ in range(14)]
    gather = run_scheduler(make_backend(path), requests, check_every_tick=False)
    static_backend = with_fixed_decode(make_backend(path))
    static = run_scheduler(static_backend, requests)
    for rid, request in gather.items():
        assert static[rid].output_token_ids == request.output_token_ids, rid
        assert static[rid].finish_reason is FinishReason.LENGTH
    mixed = static_backend.mixed
    assert mixed.decode_steps > 0 and mixed.slow_rows > 0 and mixed.decode_eager_steps == 0
    assert_no_leaks(static_backend)


def _run_mixed_params(backend, async_scheduling: bool,
                      constrained: bool = False) -> dict[str, tuple[list[int], list[float] | None, str]]:
    """Greedy, seeded (temperature / top-p / top-k) and logprob requests arriving over several ticks; with
    ``constrained`` every third one has a structured-output constraint and every third other one penalties."""
    settings = CoreSettings(max_batch_size=8, prefill_chunk_tokens=16, max_active_kv_tokens=100_000,
                            async_scheduling=async_scheduling)
    sched = ContinuousBatchScheduler(backend, settings)
    rng = random.Random(11)
    plans = []
    for i in range(10):
        params = [SamplingParams(max_tokens=rng.randrange(1, 14), temperature=0.0),
                  SamplingParams(max_tokens=rng.randrange(1, 14), temperature=0.9, top_p=0.9, seed=i),
                  SamplingParams(max_tokens=rng.randrange(1, 14), temperature=1.3, top_k=5, seed=3)][i % 3]
        if constrained and i % 3 == 1:
            spec = [{"regex": "[a-f]{2,9}"}, {"json": {"type": "object", "additionalProperties": False, "required": ["k"],
                                                       "properties": {"k": {"type": "integer", "maximum": 99}}}}][i % 2]
            params = dataclasses.replace(params, structured_outputs=spec, max_tokens=40)
        elif constrained and i % 3 == 2:  # penalties: the next logits depend on the tokens so far too
            params = dataclasses.replace(params, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2)
        prompt = tuple(rng.randrange(4, 500) for _ in range(rng.randrange(1, 20)))
        plans.append((Request(f"r{i}", prompt, params, want_logprobs=i % 4 == 1), rng.randrange(0, 8)))
    for tick in range(10_000):
        for request, arrival in plans:
            if arrival == tick:
                sched.add_request(request)
        if tick > 8 and not sched.has_work:
            break
        sched.step()
        sched.check_integrity()
        backend.check_integrity()
    return {r.request_id: (list(r.output_token_ids), list(r.output_logprobs) or None, r.finish_reason.value)
            for r, _ in plans}


@pytest.mark.parametrize("fixed_tick_buffers", [False, True])
def test_async_decode_gives_the_synchronous_tokens_and_logprobs(tiny_gemma4_dir, fixed_tick_buffers):
    """Ticks fed from the previous step's device tokens (asynchronous scheduling, decode-only and
    prompt-carrying ticks; on the fixed buffers or eager batches) give exactly the tokens, logprobs and finish
    reasons of synchronous scheduling; rows do feed on the device."""
    sync = with_fixed_decode(make_backend(tiny_gemma4_dir), fixed_buffers=fixed_tick_buffers)
    expected = _run_mixed_params(sync, async_scheduling=False)
    assert sync.mixed.fed_rows == 0
    fast = with_fixed_decode(make_backend(tiny_gemma4_dir), fixed_buffers=fixed_tick_buffers)
    launched = []
    original = fast.forward_step_async
    fast.forward_step_async = lambda *a, **k: launched.append(1) or original(*a, **k)
    got = _run_mixed_params(fast, async_scheduling=True)
    assert {rid: (tokens, reason) for rid, (tokens, _, reason) in got.items()} == {
        rid: (tokens, reason) for rid, (tokens, _, reason) in expected.items()}
    for rid, (_, logprobs, _) in got.items():  # a finished row's extra step changes the batch: fp32 rounding
        assert (logprobs is None) == (expected[rid][1] is None), rid
        if logprobs is not None:
            assert logprobs == pytest.approx(expected[rid][1], abs=1e-5), rid
    assert launched, "prompt-carrying ticks went through forward_step_async"
    assert fast.mixed.fed_rows > 0
    assert (fast.mixed.decode_eager_steps == 0) == fixed_tick_buffers
    assert_no_leaks(fast)


def test_async_scheduling_with_constrained_rows_gives_the_synchronous_tokens(tiny_gemma4_dir):
    """Structured-output rows need their previous token for their next mask, penalized rows for their counts:
    with them in the batch the scheduler applies each launched step before the next launch, and every request's
    tokens are those of synchronous scheduling; the constrained outputs are complete (stop)."""
    expected = _run_mixed_params(with_fixed_decode(make_backend(tiny_gemma4_dir)), False, constrained=True)
    fast = with_fixed_decode(make_backend(tiny_gemma4_dir))
    got = _run_mixed_params(fast, True, constrained=True)
    assert {rid: (tokens, reason) for rid, (tokens, _, reason) in got.items()} == {
        rid: (tokens, reason) for rid, (tokens, _, reason) in expected.items()}
    constrained = [got[f"r{i}"] for i in range(10) if i % 3 == 1]
    assert all(reason == "stop" for _, _, reason in constrained), constrained
    assert_no_leaks(fast)


def test_async_decode_conformance(tiny_gemma4_dir):
    """The conformance kit's decode_step_async test on decode-only ticks of the fixed buffers (device-fed rows,
    a row leaving and one joining with a step in flight)."""
    backend = with_fixed_decode(make_backend(tiny_gemma4_dir))
    BackendContractTests().test_decode_step_async_feeds_on_the_previous_step(backend)
    assert backend.mixed.fed_rows > 0
    with pytest.raises(ValueError, match="do not index the previous step"):
        with backend.lock:
            result = backend.prefill([5, 6, 7])
            batch = backend.splice_into_batched(None, result.kv, backend.kv_length(result.kv))
            try:
                backend.decode_step_async(batch, [0], [0], [RowSampling(0.0, 1.0, 0, 0, 0)])  # no previous step
            finally:
                backend.remove_row_from_cache(batch, 0)
    assert_no_leaks(backend)


def test_fixed_buffer_decode_logits_and_greedy_fast_path(tiny_gemma4_dir):
    gather = make_backend(tiny_gemma4_dir)
    static = with_fixed_decode(make_backend(tiny_gemma4_dir))
    prompts = [[5, 17, 42, 7, 99], [(7 * i + 3) % 500 + 4 for i in range(19)], [9] * 3]
    logits = {}
    for key, backend in (("gather", gather), ("static", static)):
        with backend.lock:
            rows = [backend.prefill(p) for p in prompts]
            batch = backend.stack_caches_left_padded([r.kv for r in rows])
            tokens = [int(r.last_logits.argmax()) for r in rows]
            steps = []
            for _ in range(6):
                step = backend.decode_step_batched(batch, tokens)
                steps.append(step.clone())
                assert (backend.mixed.greedy_tokens(step) is not None) == (key == "static")  # in-forward argmax
                greedy = [RowSampling(0.0, 1.0, 0, 0, 0)] * len(rows)
                tokens = backend.sample(step, greedy).token_ids
                assert tokens == sample_tokens(step.double(), greedy).token_ids
            logits[key] = torch.stack(steps)
            while len(batch):
                backend.remove_row_from_cache(batch, 0)
        assert_no_leaks(backend)
    # the two backends prefill through different tick attention (Triton under the interpreter / reference)
    torch.testing.assert_close(logits["static"], logits["gather"], rtol=0, atol=5e-5)
    stale = logits["static"][0].clone()
    assert static.mixed.greedy_tokens(stale) is None  # only the tensor the last step returned


def test_fixed_buffer_decode_matches_contiguous_reference_alone(tiny_gemma4_dir):
    backend = with_fixed_decode(make_backend(tiny_gemma4_dir))
    prompt = [(5 * i + 9) % 500 + 4 for i in range(29)]
    assert solo_greedy(backend, prompt, 12) == solo_greedy(make_backend(tiny_gemma4_dir), prompt, 12)


def test_settings_of_the_fast_paths(monkeypatch):
    custom = load_custom_settings()
    assert (custom.cuda_graph, custom.graph_capture, custom.prefill_attention, custom.fuse) == (
        True, "lazy", "auto", "auto")
    assert resolve_fast_paths(custom, "cuda") == ("sdpa", True)
    assert resolve_fast_paths(custom, "cpu") == ("eager", False)
    monkeypatch.setenv("CUSTOM_BACKEND_PREFILL_ATTENTION", "eager")
    monkeypatch.setenv("CUSTOM_BACKEND_FUSE", "off")
    monkeypatch.setenv("CUSTOM_BACKEND_GRAPH_CAPTURE", "startup")
    custom = load_custom_settings()
    assert resolve_fast_paths(custom, "cuda") == ("eager", False) and custom.graph_capture == "startup"
    assert resolve_fast_paths(load_custom_settings(fuse="on", prefill_attention="sdpa"), "cpu") == ("sdpa", True)
    from gemmaserve.errors import ConfigurationError

    monkeypatch.setenv("CUSTOM_BACKEND_GRAPH_CAPTURE", "always")
    with pytest.raises(ConfigurationError, match="CUSTOM_BACKEND_GRAPH_CAPTURE="):
        load_custom_settings()


@pytest.mark.parametrize("name", ["gemma4", "gemma4_k_eq_v", "gemma4_moe"])
def test_fused_projections_keep_weights_and_tokens(tiny_checkpoint, name):
    path = tiny_checkpoint(name)
    plain = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
    fused = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    assert fuse_projections(fused) > 0 and is_fused(fused) and fuse_projections(fused) == 0
    after = fused.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    layer = next(layer for layer in fused.layers if layer.self_attn.fused_qkv is not None)
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.fused_qkv.data_ptr()  # views, no copy
    prompt = [(5 * i + 9) % 500 + 4 for i in range(21)]
    ids = torch.tensor([prompt])
    from gemmaserve_custom_torch.models import ContiguousKVContext

    with torch.inference_mode():
        out = [m(ids, torch.arange(len(prompt))[None], ContiguousKVContext(m.config)) for m in (plain, fused)]
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1].argmax(-1), out[0].argmax(-1))


def test_sdpa_prefill_matches_eager_on_cpu(tiny_gemma4_dir):
    """fp32 SDPA (math kernel on CPU) through chunked prefill with old keys + window: same greedy tokens."""
    prompt = [(7 * i + 3) % 500 + 4 for i in range(37)]
    eager = make_backend(tiny_gemma4_dir, prefill_chunk_tokens=5)
    sdpa = make_backend(tiny_gemma4_dir, prefill_chunk_tokens=5, prefill_attention="sdpa")
    assert sdpa.runner.prefill_attention == "sdpa" and eager.runner.prefill_attention == "eager"
    results = []
    for backend in (eager, sdpa):  # the one-row fallback path, where the setting applies
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            while not state.is_complete:
                backend._prefill_alone(state, min(5, state.num_remaining))
            results.append(state.last_logits.clone())
            backend.free_row_kv(state.kv)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["prefill_graph", "batched_prefill"])
def test_removed_settings_are_refused_with_the_reason(monkeypatch, name):
    from gemmaserve.errors import ConfigurationError

    monkeypatch.setenv(f"CUSTOM_BACKEND_{name.upper()}", "1")
    with pytest.raises(ConfigurationError, match=f"CUSTOM_BACKEND_{name.upper()} was removed"):
        load_custom_settings()


def test_padding_rows_touch_only_the_scratch_block(tiny_gemma4_dir):
    """3 rows run in bucket 4: the step writes each row's new-token block and the scratch block, nothing else."""
    backend = with_fixed_decode(make_backend(tiny_gemma4_dir, block_size=4), max_batch_size=8)
    pools = backend.pools
    rows = _rows_of(backend, [[5, 6, 7], [8] * 6, [(3 * i) % 400 + 4 for i in range(13)]])
    with backend.lock:
        batch = backend.stack_caches_left_padded(rows)
        for layer in pools.k:  # the prefill ticks' padding tokens wrote the same K/V there: poison it
            group = pools.group_of_layer[layer]
            pools.k[layer][pools.scratch_block(group)] = 7.0
            pools.v[layer][pools.scratch_block(group)] = 7.0
        before = {layer: (pools.k[layer].clone(), pools.v[layer].clone()) for layer in pools.k}
        targets = {g: {row.tables[g][row.length // 4] if row.length % 4 else None for row in rows}
                   for g in pools.groups}
        backend.decode_step_batched(batch, [9, 10, 11])
        for layer, (k_before, v_before) in before.items():
            group = pools.group_of_layer[layer]
            changed = ((pools.k[layer] != k_before) | (pools.v[layer] != v_before)).flatten(1).any(1)
            changed_ids = set(changed.nonzero().flatten().tolist())
            allowed = {b for row in rows for b in row.tables[group]} | {pools.scratch_block(group)}
            assert changed_ids <= allowed, (layer, changed_ids)
            assert pools.scratch_block(group) in changed_ids  # the padding row wrote there
        assert targets  # (targets document which blocks the real rows write)
        while len(batch):
            backend.remove_row_from_cache(batch, 0)
    assert_no_leaks(backend)


_RMS_SCRIPT = """
import torch
from gemmaserve_custom_torch.kernels.rms_norm import rms_norm
from gemmaserve_custom_torch.models.layers import RMSNorm
torch.manual_seed(0)
worst = 0.0
for style in ("w", "one_plus_w"):
    for with_weight in (True, False):
        norm = RMSNorm(48, 1e-6, style, with_weight=with_weight)
        if with_weight:
            norm.weight.data = torch.randn(48)
        fused = torch.randn(2, 3, 5 * 48 + 7)[..., 7:]  # heads sliced out of a wider projection
        for x in (torch.randn(3, 4, 48), fused.reshape(2, 3, 5, 48), torch.randn(48), torch.randn(0, 48)):
            got, want = rms_norm(x, norm.weight, norm.eps, style), norm(x)
            assert got.shape == want.shape and got.is_contiguous(), (got.shape, want.shape)
            if want.numel():
                worst = max(worst, float((got - want).abs().max()))
print(worst)
"""


def test_triton_rms_norm_matches_the_eager_module_under_interpreter():
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _RMS_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) < 1e-5


class _FakeRow:
    """What `DecodeStaging.load` reads of a row: uid, version, length, tables."""

    def __init__(self, uid: int, tables: dict[str, list[int]]) -> None:
        self.uid, self.version, self.length, self.tables = uid, 0, 3, tables


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 4), st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 30),
                                                                       st.integers(0, 9)), max_size=6)),
                      min_size=1, max_size=12))
def test_decode_state_sends_only_changed_entries_and_mirrors_the_device(tiny_gemma4_dir, steps):
    """Any sequence of steps over a changing set of rows (tables growing, shrinking, entries rewritten, rows
    joining and leaving slots): after every load the device tables equal each row's table padded with -1 (and
    padding slots hold the scratch block), and an unchanged step sends no table entry."""
    backend = make_backend(tiny_gemma4_dir, block_size=4)
    groups = list(backend.pools.groups)
    state = DecodeStaging(backend.pools, torch.zeros(12, dtype=torch.int64),
                          torch.full((len(groups), 4, 10), -1, dtype=torch.int32), capacity=4, width=10)
    pool = [_FakeRow(uid, {g: [uid + 1] for g in groups}) for uid in range(6)]
    for k, (count, edits) in enumerate(steps):
        for which, value, column in edits:  # edit a row's table: set/extend (value >= 0) or truncate (-1)
            row = pool[which]
            for group in groups:
                table = row.tables[group]
                if value < 0:
                    del table[column:]
                elif column < len(table):
                    table[column] = value
                else:
                    table.append(value)
            row.version += 1
        rows = pool[:count] if k % 2 else pool[-count:]  # rows move between slots
        state.load(rows, [1] * count, bucket=4)
        state.check_integrity(rows)
        device = {g: state.tables[g].tolist() for g in groups}
        for i in range(4):
            for group in groups:
                want = rows[i].tables[group] if i < count else [backend.pools.scratch_block(group)]
                assert device[group][i] == want + [-1] * (10 - len(want))
        sent = state.entries_copied
        state.load(rows, [1] * count, bucket=4)
        assert state.entries_copied == sent
