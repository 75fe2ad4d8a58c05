"""Decode-only ticks through `MixedStep` (CPU): the padded fixed-buffer forward (what the decode CUDA graphs
replay, run eagerly) gives the unpadded eager forward's logits, fed or not from the previous step's device
tokens; a decode-only batch runs the paged decode kernel, a tick with prompt tokens the ragged one (Triton
under the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures_backend import assert_no_leaks, make_backend
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve_custom_torch.mixed_step import MixedStep

PROMPTS = [[5, 17, 42, 7, 99], [(7 * i + 3) % 500 + 4 for i in range(19)], [9] * 3, [11, 12], list(range(4, 30))]


def _fixed(backend):
    width = -(-backend.model_info.max_model_len // backend.block_size)
    backend.mixed = MixedStep(backend.model, backend.pools, "reference", fixed_buffers=True, max_tokens=64,
                              max_seqs=8, width=width)
    return backend


@pytest.mark.parametrize("name", ["gemma4", "gemma3"])
@pytest.mark.parametrize("count", [3, 5])
def test_padded_decode_tick_gives_the_unpadded_logits_with_async_sources(tiny_checkpoint, name, count):
    """``count`` rows pad to bucket 4 / 8; every other step feeds some rows from the previous step's device
    tokens (``sources``), the others from the host ids."""
    path = tiny_checkpoint(name)
    eager, padded = make_backend(path), _fixed(make_backend(path))
    runs = {}
    for key, backend in (("eager", eager), ("padded", padded)):
        mixed = backend.mixed
        with backend.lock:
            rows = [backend.prefill(p).kv for p in PROMPTS[:count]]
            ids, previous, sources = [3] * count, None, None
            steps = []
            for step in range(9):
                logits = mixed.run(rows, ids, [], sources, previous)[0]
                steps.append(logits.clone())
                tokens = logits.argmax(-1)
                if step % 2:  # rows 0 and 2 take the previous tokens in reverse order on the device
                    previous, sources = tokens, [count - 1, -1, 0, *[-1] * (count - 3)]
                    ids = [0 if s >= 0 else t for s, t in zip(sources, tokens.tolist())]
                else:
                    previous, sources, ids = None, None, tokens.tolist()
            runs[key] = torch.stack(steps)
            for row in rows:
                row.free_all()
        assert_no_leaks(backend)
    assert padded.mixed.decode_eager_steps == 0 and padded.mixed.decode_steps == 9
    assert eager.mixed.decode_eager_steps == 9 and eager.mixed.buffers is None
    assert padded.mixed.fed_rows == eager.mixed.fed_rows == 4 * 2
    assert padded.mixed.buffers.decode.rows_copied > 0
    # fp32 rounding of padded matmul shapes (and of the padded prefill ticks before)
    torch.testing.assert_close(runs["padded"], runs["eager"], rtol=0, atol=1e-4)
    assert torch.equal(runs["padded"].argmax(-1), runs["eager"].argmax(-1))


def test_decode_tick_after_a_prompt_tick_reads_its_own_tables(tiny_gemma4_dir):
    """A tick with prompt tokens (its rows in other slots) stages tables of its own: the next decode-only tick
    on the fixed buffers still reads each row's own blocks (same logits as the eager path)."""
    eager, padded = make_backend(tiny_gemma4_dir), _fixed(make_backend(tiny_gemma4_dir))
    out = []
    for backend in (eager, padded):
        with backend.lock:
            rows = [backend.prefill(p).kv for p in PROMPTS[:2]]
            first = backend.mixed.run(rows, [3, 4], [])[0].clone()
            state = backend.prefill_lookup(PROMPTS[4])
            backend.mixed.run(rows[::-1], [5, 6], [(state.kv, PROMPTS[4][:8], False)])  # rows swap slots
            second = backend.mixed.run(rows, [7, 8], [])[0].clone()
            out.append(torch.cat([first, second]))
            for row in [*rows, state.kv]:
                row.free_all()
        assert_no_leaks(backend)
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-4)
    padded.mixed.buffers.decode.check_integrity([])


def test_prompt_ticks_leave_the_decode_tables_alone(tiny_gemma4_dir):
    """Decode-only ticks keep their own device tables: after a tick with prompt tokens, a decode tick of the
    same rows sends only the blocks they appended (at most one per row and group), not their whole tables,
    and the device tables still equal the host mirror."""
    backend = _fixed(make_backend(tiny_gemma4_dir))
    staging = backend.mixed.buffers.decode
    with backend.lock:
        rows = [backend.prefill(p).kv for p in PROMPTS[:3]]
        backend.mixed.run(rows, [3, 4, 5], [])
        whole = sum(len(row.tables[g]) for row in rows for g in row.tables)
        state = backend.prefill_lookup(PROMPTS[4])
        backend.mixed.run(rows, [5, 6, 7], [(state.kv, PROMPTS[4][:8], False)])
        sent = staging.entries_copied
        backend.mixed.run(rows, [7, 8, 9], [])
        assert staging.entries_copied - sent <= len(rows) * len(staging.groups) < whole
        staging.check_integrity(rows)
        for row in [*rows, state.kv]:
            row.free_all()
    assert_no_leaks(backend)


_KERNEL_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
from fixtures_backend import make_backend
from gemmaserve_custom_torch.kernels import paged_attention, ragged_attention

calls = {{"decode": 0, "ragged": 0}}
def counting(name, fn):
    def wrapped(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapped
paged_attention.paged_decode_attention = counting("decode", paged_attention.paged_decode_attention)
ragged_attention.ragged_paged_attention = counting("ragged", ragged_attention.ragged_paged_attention)
torch.set_num_threads(1)
backend = make_backend({path!r}, attention="triton", kv_blocks=48)
out = {{}}
with backend.lock:
    rows = [backend.prefill([5, 6, 7, 8, 9]).kv, backend.prefill([3, 4, 5]).kv]
    before = dict(calls)
    backend.mixed.run(rows, [3, 4], [])
    out["decode_only"] = {{k: calls[k] - before[k] for k in calls}}
    state = backend.prefill_lookup([11, 12, 13, 14])
    before = dict(calls)
    backend.mixed.run(rows, [5, 6], [(state.kv, [11, 12, 13, 14], True)])
    out["mixed"] = {{k: calls[k] - before[k] for k in calls}}
    out["layers"] = backend.model.config.num_hidden_layers
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-interpreter test: on CUDA the compiled kernels run "
                    "(test_cuda_*), and the H200 image's Triton 3.6 interpreter fails inside the ragged kernel's "
                    "launch (InterpreterError: only 0-dimensional arrays can be converted to Python scalars)")
def test_decode_only_batches_run_the_decode_kernel_under_the_interpreter(tiny_gemma4_dir):
    pytest.importorskip("triton")
    script = _KERNEL_SCRIPT.format(tests=str(Path(__file__).parent), path=str(tiny_gemma4_dir))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["decode_only"] == {"decode": out["layers"], "ragged": 0}, out  # every layer, the decode kernel
    assert out["mixed"]["ragged"] > 0, out  # a tick with prompt tokens: the ragged kernel


@pytest.mark.parametrize("name", ["gemma4", "gemma3"])
def test_prompt_ticks_pad_their_logits_rows_only_to_a_logits_bucket(tiny_checkpoint, name):
    """On buffers with room for many sequences, a tick of a few decode rows beside a chunk computes its logits rows
    (and the narrowed KV-shared layers: the tiny Gemma 4 has three; Gemma 3 has none, its logits rows are picked
    from the last layer) padded to ``logit_rows_for``, fewer than the bucket's sequence count, and gives the
    unpadded batch's logits, chunk logits included."""
    from gemmaserve_custom_torch.kv.forward_batch import logit_buckets

    path = tiny_checkpoint(name)
    eager, padded = make_backend(path), make_backend(path)
    padded.mixed = MixedStep(padded.model, padded.pools, "reference", fixed_buffers=True, max_tokens=128,
                             max_seqs=64, width=-(-padded.model_info.max_model_len // padded.block_size))
    buffers = padded.mixed.buffers
    views: list[tuple[int, int]] = []  # (bucket, logits rows) of each padded forward
    view = buffers.view

    def spy(bucket: int, logit_rows: int | None = None):
        batch = view(bucket, logit_rows)
        views.append((bucket, int(batch.logit_seqs.shape[0])))
        return batch

    buffers.view = spy
    out = []
    for backend in (eager, padded):
        with backend.lock:
            rows = [backend.prefill(p).kv for p in PROMPTS[:3]]
            prompts = [PROMPTS[4][:14], PROMPTS[1][:14]]  # two chunks each (the window, 8, caps a chunk)
            states = [backend.prefill_lookup(p) for p in prompts]
            views.clear()  # the prompts' own ticks above
            first, _, _ = backend.mixed.run(rows, [3, 4, 5], [(s.kv, p[:8], False) for s, p in zip(states, prompts)])
            first = first.clone()  # 19 tokens: bucket 32, room for 32 sequences, 3 logits rows wanted
            second, chunk_logits, _ = backend.mixed.run(rows, [6, 7, 8],
                                                        [(s.kv, p[8:], True) for s, p in zip(states, prompts)])
            out.append(torch.cat([first, second, *chunk_logits]))
            for row in [*rows, *(s.kv for s in states)]:
                row.free_all()
        assert_no_leaks(backend)
    assert views == [(32, 16), (16, 16)] and logit_buckets(buffers.seqs_of(32)) == (16, 32)
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-4)
    assert torch.equal(out[1].argmax(-1), out[0].argmax(-1))
