"""Paged KV vs the unpaged reference: prefill (one chunk and chunked), batched decode, pool layout, the
Triton decode path under the interpreter, and the integrity checker itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fixtures_backend import FULL, SLIDING, assert_no_leaks, contiguous_greedy, make_backend
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve_custom_torch.models import ContiguousKVContext

PROMPT_SHORT = [5, 17, 42, 7, 99]  # shorter than the window (8): the window never bites
PROMPT_LONG = [(7 * i + 3) % 500 + 4 for i in range(37)]  # several windows, not block-aligned


def reference_last_logits(model, prompt):
    ctx = ContiguousKVContext(model.config)
    with torch.inference_mode():
        return model(torch.tensor([prompt]), ctx.next_positions(1, len(prompt)), ctx, logits_to_keep=1)[0, -1]


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_k_eq_v"])
@pytest.mark.parametrize(("prompt", "path"), [(PROMPT_SHORT, "tick"), (PROMPT_SHORT, "one-row"),
                                              (PROMPT_LONG, "one-row"), (PROMPT_LONG, "tick")],
                         ids=["short-tick", "short-one-row", "long-one-row", "long-tick"])
def test_one_chunk_prefill_is_bitwise_the_reference(tiny_checkpoint, name, prompt, path):
    """fp32, full prefill (fast prefill off): a prompt within the window, prefilled in one tick, and any
    prompt on the one-row path (one forward, whatever its length) give the reference's logits bit for bit.
    A prompt past the window runs in ticks of at most W tokens (other matmul shapes than one forward): equal
    to fp32 rounding, same argmax."""
    backend = make_backend(tiny_checkpoint(name), fast_prefill=False)
    with backend.lock:
        state = backend.prefill_lookup(prompt)
        if path == "tick":
            backend.prefill_chunk(state, len(prompt))
        else:
            backend._prefill_alone(state, len(prompt))
        reference = reference_last_logits(backend.model, prompt)
        if path == "tick" and len(prompt) > backend.model.config.sliding_window:
            torch.testing.assert_close(state.last_logits[0], reference, rtol=0, atol=1e-5)
            assert int(state.last_logits.argmax()) == int(reference.argmax())
        else:
            assert torch.equal(state.last_logits[0], reference)
        backend.free_row_kv(state.kv)
    assert_no_leaks(backend)


@pytest.mark.parametrize("chunk", [1, 3, 4, 9, 20])
def test_chunked_prefill_equals_unchunked(tiny_gemma4_dir, chunk):
    backend = make_backend(tiny_gemma4_dir)
    with backend.lock:
        whole = backend.prefill_lookup(PROMPT_LONG)
        backend.prefill_chunk(whole, len(PROMPT_LONG))
        state = backend.prefill_lookup(PROMPT_LONG)
        while not state.is_complete:
            backend.prefill_chunk(state, chunk)
            assert state.kv.length == state.num_computed
            state.kv.check_integrity()
        torch.testing.assert_close(state.last_logits, whole.last_logits, rtol=0, atol=1e-5)
        assert int(state.last_logits.argmax()) == int(whole.last_logits.argmax())
        # both rows hold the same K/V where both hold it
        for layer, k_pool in backend.pools.k.items():
            group = backend.pools.group_of_layer[layer]
            pairs = zip(whole.kv.tables[group], state.kv.tables[group])
            held = [j for j, (a, b) in enumerate(pairs) if a >= 0 and b >= 0]
            assert held, "the rows share no block"
            a = k_pool[[whole.kv.tables[group][j] for j in held]]
            b = k_pool[[state.kv.tables[group][j] for j in held]]
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        backend.free_row_kv(whole.kv)
        backend.free_row_kv(state.kv)
    assert_no_leaks(backend)


def test_pools_hold_exactly_the_reference_kv(tiny_gemma4_dir):
    """Layout: position p of a row is slot p % bs of block table[p // bs] in its layer's pool."""
    backend = make_backend(tiny_gemma4_dir)
    config = backend.model.config
    assert sorted(backend.pools.k) == list(config.kv_storing_layers), "KV-shared layers must store nothing"
    assert backend.pools.group_of_layer[5] == FULL and backend.pools.group_of_layer[3] == SLIDING
    stored = {}

    class Recording(ContiguousKVContext):
        def _append(self, layer_idx, k, v):
            step = super()._append(layer_idx, k, v)
            stored[layer_idx] = step.keys[0].transpose(0, 1)  # [K, H, D], positions 0..K-1
            return step

    ref = Recording(config)
    prompt = PROMPT_LONG[:21]
    with torch.inference_mode():
        backend.model(torch.tensor([prompt]), ref.next_positions(1, len(prompt)), ref)
    with backend.lock:  # the one-row path: one forward, as the reference (the tick path: test_mixed_step.py)
        state = backend.prefill_lookup(prompt)
        backend._prefill_alone(state, len(prompt))
        row = state.kv
        for layer, keys in stored.items():
            group = backend.pools.group_of_layer[layer]
            first = backend.pools.geometry[group].keep_from(len(prompt))
            slots = row.slots(group, first, len(prompt))
            got = backend.pools.k[layer].view(-1, *keys.shape[1:])[slots]
            assert torch.equal(got, keys[first:]), f"layer {layer}"
        backend.free_row_kv(row)


@pytest.mark.parametrize("name", ["gemma4", "gemma3"])
def test_batch_of_one_decode_is_bitwise_the_reference(tiny_checkpoint, name):
    backend = make_backend(tiny_checkpoint(name))
    model = backend.model
    ctx = ContiguousKVContext(model.config)
    prompt = PROMPT_LONG[:11]
    with backend.lock, torch.inference_mode():
        state = backend.prefill_lookup(prompt)
        backend._prefill_alone(state, len(prompt))  # one forward, as the reference
        batch = backend.splice_into_batched(None, state.kv, len(prompt))
        ref = model(torch.tensor([prompt]), ctx.next_positions(1, len(prompt)), ctx, logits_to_keep=1)
        token = int(ref[0, -1].argmax())
        for _ in range(14):  # crosses several blocks and windows
            got = backend.decode_step_batched(batch, [token])
            ref = model(torch.tensor([[token]]), ctx.next_positions(1, 1), ctx, logits_to_keep=1)
            assert torch.equal(got[0], ref[0, -1])
            token = int(ref[0, -1].argmax())
        backend.remove_row_from_cache(batch, 0)
    assert_no_leaks(backend)


def test_left_padded_batched_decode_matches_each_row_alone(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    prompts = [PROMPT_SHORT, PROMPT_LONG, PROMPT_LONG[:13], [3]]
    steps = 9
    expected = [contiguous_greedy(backend.model, p, steps + 1) for p in prompts]
    with backend.lock:
        rows = []
        for prompt in prompts:
            result = backend.prefill(prompt)
            rows.append(result.kv)
        batch = backend.stack_caches_left_padded(rows)
        tokens = [[e[0]] for e in expected]
        for _ in range(steps):
            logits = backend.decode_step_batched(batch, [t[-1] for t in tokens])
            for i, token in enumerate(logits.argmax(-1).tolist()):
                tokens[i].append(token)
            batch.check_integrity()
        assert tokens == expected
        for i in reversed(range(len(prompts))):
            backend.remove_row_from_cache(batch, i)
    assert_no_leaks(backend)


def test_integrity_check_catches_leaks_and_double_frees(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    with backend.lock:
        result = backend.prefill(PROMPT_SHORT)
        backend.check_integrity()
        block = result.kv.tables[FULL][0]
        backend.pools.incref(FULL, [block])  # a reference nobody accounts for
        with pytest.raises(RuntimeError, match="leak or double free"):
            backend.check_integrity()
        backend.pools.decref(FULL, [block])
        result.kv.tables[SLIDING][0] = -1  # the row forgets a block the next query needs
        with pytest.raises(RuntimeError):
            backend.check_integrity()


_TRITON_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from fixtures_backend import make_backend
    prompts = [[5, 17, 42, 7, 99], [(7 * i + 3) % 500 + 4 for i in range(19)]]
    out = {{}}
    for mode in ("gather", "triton"):
        backend = make_backend({path!r}, attention=mode)
        assert backend.attention == mode
        with backend.lock:
            rows = [backend.prefill(p) for p in prompts]
            batch = backend.stack_caches_left_padded([r.kv for r in rows])
            tokens = [int(r.last_logits.argmax()) for r in rows]
            logits = []
            for _ in range(2):
                step = backend.decode_step_batched(batch, tokens)
                logits.append(step.tolist())
                tokens = step.argmax(-1).tolist()
        out[mode] = logits
    print(json.dumps(out))
    """
)


def test_triton_decode_matches_gather_under_interpreter(tiny_gemma4_dir):
    pytest.importorskip("triton")
    script = _TRITON_SCRIPT.format(tests=str(Path(__file__).parent), path=str(tiny_gemma4_dir))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    gather, triton = torch.tensor(out["gather"]), torch.tensor(out["triton"])
    torch.testing.assert_close(triton, gather, rtol=0, atol=1e-4)
    assert torch.equal(triton.argmax(-1), gather.argmax(-1))


def test_attention_contexts_used_directly_are_consistent(tiny_gemma4_dir):
    """The contexts the runner builds, driven by hand: they hold what their check_integrity promises."""
    from gemmaserve_custom_torch.kv import DecodeBatchContext, PagedKVCache
    from gemmaserve_custom_torch.kv.forward_batch import build_forward_batch, pack_tick
    from gemmaserve_custom_torch.runner import PagedPrefillContext

    backend = make_backend(tiny_gemma4_dir)
    model, pools = backend.model, backend.pools
    row = PagedKVCache(pools)
    prompt = PROMPT_LONG[:10]
    row.prepare_append(len(prompt))
    ctx = PagedPrefillContext(pools, row, 0, len(prompt), {})
    with torch.inference_mode():
        model.forward_hidden(torch.tensor([prompt]), ctx.q_positions[None], ctx)
    ctx.check_integrity()
    assert sorted(ctx._steps) == list(model.config.kv_storing_layers)
    row.commit_append(len(prompt))
    batch = backend.stack_caches_left_padded([row])
    row.prepare_append(1)
    decode = build_forward_batch(pools, pack_tick(pools, [row], [[9]], [0], decode_only=True), torch.device("cpu"), [])
    dctx = DecodeBatchContext(model.config, pools, decode, "reference")
    with torch.inference_mode():
        model.forward_hidden(decode.ids[:, None], decode.positions[:, None], dctx)
    dctx.check_integrity()
    assert set(dctx._gathered) == set(model.config.kv_storing_layers)
    row.commit_append(1)
    dctx.batch.seq_lens = dctx.batch.seq_lens[:0]
    with pytest.raises(RuntimeError, match="batch size"):
        dctx.check_integrity()
    backend.remove_row_from_cache(batch, 0)
    assert_no_leaks(backend)


def test_copy_blocks_copies_every_layer_of_the_group_and_nothing_else(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir, block_size=4)
    pools = backend.pools
    for group, spec in pools.groups.items():
        source, target, other = pools.allocate(group, 3)
        for layer in spec.layers:
            for pool in (pools.k[layer], pools.v[layer]):
                pool[source].normal_()
                pool[target].zero_()
                pool[other].fill_(7.0)
        pools.copy_blocks(group, [source], [target])
        for layer in spec.layers:
            for pool in (pools.k[layer], pools.v[layer]):
                assert torch.equal(pool[target], pool[source]) and bool((pool[other] == 7.0).all())
        with pytest.raises(ValueError, match="source blocks"):
            pools.copy_blocks(group, [source], [])
        pools.decref(group, [source, target, other])
    pools.check_integrity()


def test_copy_on_write_gives_the_row_a_private_copy_of_a_shared_block(tiny_gemma4_dir):
    """Appending into a block another holder shares (the prefix cache after a full prompt hit) replaces it in the
    row by a fresh block holding the same K/V in every layer; the shared block keeps its data and loses the row's
    reference; blocks the append does not touch stay shared."""
    from gemmaserve_custom_torch.kv import PagedKVCache

    backend = make_backend(tiny_gemma4_dir, block_size=4)
    pools = backend.pools
    holder = PagedKVCache(pools)
    holder.prepare_append(6)
    holder.commit_append(6)  # blocks 0 and 1 (positions 0-5)
    for group, spec in pools.groups.items():
        for layer in spec.layers:
            for pool in (pools.k[layer], pools.v[layer]):
                for block in holder.tables[group]:
                    pool[block].normal_()  # a basic index: in place (a list index would fill a copy)
    before = {group: [(pools.k[layer][holder.tables[group][1]].clone(), pools.v[layer][holder.tables[group][1]].clone())
                      for layer in spec.layers] for group, spec in pools.groups.items()}
    assert all(bool(k.abs().sum() > 0) and bool(v.abs().sum() > 0) for pairs in before.values() for k, v in pairs)
    row = PagedKVCache(pools)
    row.adopt({group: list(table) for group, table in holder.tables.items()}, 6)
    row.prepare_append(1)  # position 6 lies in the shared block 1
    for group, spec in pools.groups.items():
        shared, fresh = holder.tables[group][1], row.tables[group][1]
        assert fresh != shared and pools.refcount(group, fresh) == 1 and pools.refcount(group, shared) == 1
        assert row.tables[group][0] == holder.tables[group][0] and pools.refcount(group, row.tables[group][0]) == 2
        for layer, (k, v) in zip(spec.layers, before[group]):
            for pool, expected in ((pools.k[layer], k), (pools.v[layer], v)):
                assert torch.equal(pool[fresh], expected) and torch.equal(pool[shared], expected)
    row.free_all()
    holder.free_all()
    pools.check_integrity()
    assert_no_leaks(backend)


def test_a_failed_copy_on_write_frees_the_fresh_blocks(tiny_gemma4_dir, monkeypatch):
    """If the copy raises (e.g. telling a dead tensor-parallel worker), the row keeps its shared blocks and the
    fresh ones go back to the pool: nothing leaks."""
    from gemmaserve_custom_torch.kv import PagedKVCache

    backend = make_backend(tiny_gemma4_dir, block_size=4)
    pools = backend.pools
    holder = PagedKVCache(pools)
    holder.prepare_append(6)
    holder.commit_append(6)
    row = PagedKVCache(pools)
    row.adopt({group: list(table) for group, table in holder.tables.items()}, 6)
    free = {group: pools.managers[group].num_free for group in pools.groups}

    def broken(*args, **kwargs):
        raise RuntimeError("worker gone")

    monkeypatch.setattr(pools, "copy_blocks", broken)
    with pytest.raises(RuntimeError, match="worker gone"):
        row.prepare_append(1)
    for group in pools.groups:
        assert row.tables[group][:2] == holder.tables[group][:2]
        assert pools.refcount(group, holder.tables[group][1]) == 2
    assert {group: pools.managers[group].num_free for group in pools.groups} == free  # the fresh blocks went back
    monkeypatch.undo()
    row.free_all()
    holder.free_all()
    pools.check_integrity()
    assert_no_leaks(backend)
