"""The fused Gumbel-max kernel (``gemmaserve.triton_sampling``) picks the definition's token: on CPU under
``TRITON_INTERPRET=1`` (fp32 / fp16 / float64 logits, odd vocabularies and blocks, tiny and huge temperatures,
greedy rows, -inf entries and rows, masks empty or shorter than the vocabulary, bans and biases) against the
torch path of ``sample_on_device`` and the pure-Python ``sample_rows``, in a subprocess (the flag must be set
before triton is imported); its sm_90 build without a GPU (libdevice's float64 log, IEEE division); and on CUDA
(``gpu``) against the torch path at 262,144 bf16 tokens, with no host sync and under CUDA-graph capture."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from gemmaserve.engine.sampling_cpu import sampling_seed  # noqa: E402
from gemmaserve.sampling_params import RowSampling  # noqa: E402
from gemmaserve.torch_sampling import _signed64, sample_on_device  # noqa: E402

_INTERPRETED = r"""
import math, os, sys
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from gemmaserve import triton_sampling
from gemmaserve.engine.sampling_cpu import sample_rows, sampling_seed
from gemmaserve.sampling_params import RowSampling
from gemmaserve.torch_sampling import _fused_tokens, _packed_allowed, _signed64, sample_tokens
torch.set_num_threads(1)

def mask_for(kind, vocab, data):
    if kind == "none":
        return None
    if kind == "empty":
        return b""
    width = -(-vocab // 8)
    length = {"full": width, "short": max(1, width // 2), "long": width + 3}[kind]
    return bytes(data.draw(st.lists(st.integers(0, 255), min_size=length, max_size=length)))

row_spec = st.tuples(st.sampled_from([0.0, 1.0, 0.7, 2.5, 1e-6, 1e-30, 1e6]), st.integers(0, 2**63 - 1),
                     st.integers(0, 1000), st.sampled_from(["none", "none", "full", "short", "long", "empty"]),
                     st.sampled_from(["none", "none", "inf", "all_inf", "banned", "bias"]))

@settings(max_examples=int(sys.argv[1]), deadline=None, database=None, derandomize=sys.argv[2] == "1",
          suppress_health_check=list(HealthCheck))
@given(specs=st.lists(row_spec, min_size=1, max_size=7), vocab=st.sampled_from([1, 37, 300, 1000]),
       dtype=st.sampled_from([torch.float32, torch.float16]), block=st.sampled_from([32, 128, 512, None]),
       scale=st.sampled_from([0.05, 3.0]), data=st.data())
def check(specs, vocab, dtype, block, scale, data):
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = (torch.randn(len(specs), vocab, generator=generator) * scale).to(dtype)  # fp16 at 0.05: many ties
    rows = []
    for r, (temperature, seed, step, mask, extra) in enumerate(specs):
        if extra == "inf":
            logits[r, torch.randperm(vocab, generator=generator)[: vocab // 2]] = -math.inf
        if extra == "all_inf":
            logits[r] = -math.inf
        rows.append(RowSampling(temperature, 1.0, 0, seed, step, allowed=mask_for(mask, vocab, data),
                                banned=(0, vocab // 3, vocab + 5) if extra == "banned" else (),
                                logit_bias=((vocab - 1, 2.5), (vocab // 2, -1.0)) if extra == "bias" else ()))
    want = sample_rows([[float(x) for x in line] for line in logits], rows)[0]
    assert sample_tokens(logits, rows).token_ids == want  # the torch path (CPU) is the definition's
    assert _fused_tokens(logits, rows, triton_sampling).tolist() == want, (want, rows)
    if not any(row.adjusts_logits for row in rows):  # the kernel alone, at the drawn block size
        temps = torch.tensor([row.temperature for row in rows], dtype=torch.float64)
        keys = torch.tensor([_signed64(sampling_seed(row.seed, row.step)) for row in rows])
        got = triton_sampling.gumbel_argmax(logits, temps, keys, block=block)
        assert got.dtype == torch.int64 and got.tolist() == want
    checked.append(len(rows))

checked = []
check()
# a strided view (rows of a wider buffer) and a float64 input, masks shared by index
wide = torch.randn(5, 350, dtype=torch.float64)
logits = wide[:, 10:310]
rows = [RowSampling(t, 1.0, 0, 11 + r, r, allowed=(bytes([0xA5] * 38) if r % 2 else None))
        for r, t in enumerate([0.9, 0.0, 1e-6, 3.0, 1.0])]
want = sample_rows([[float(x) for x in line] for line in logits], rows)[0]
assert _fused_tokens(logits, rows, triton_sampling).tolist() == want
temps = torch.tensor([row.temperature for row in rows], dtype=torch.float64)
keys = torch.tensor([_signed64(sampling_seed(row.seed, row.step)) for row in rows])
allowed = _packed_allowed([bytes([0xA5] * 38)], 300, logits.device)
got = triton_sampling.gumbel_argmax(logits, temps, keys, allowed, torch.tensor([-1, 0, -1, 0, -1]), block=64)
assert got.tolist() == want
# the scores themselves: each block's largest score against torch's float64 ops (numpy's log, the
# interpreter's, and torch's CPU log differ in the last bit on ~0.1% of inputs; on CUDA both are libdevice's)
sys.path.insert(0, sys.argv[3])
from test_triton_sampling import reference_maxima
generator = torch.Generator().manual_seed(5)
for dtype, vocab, block in ((torch.float32, 4096, 128), (torch.float16, 1000, 64)):
    logits = (torch.randn(6, vocab, generator=generator) * 3).to(dtype)
    logits[1, ::3] = -math.inf
    temps = torch.tensor([1.0, 0.0, 0.37, 1e-6, 40.0, 0.9], dtype=torch.float64)
    keys = torch.tensor([_signed64(sampling_seed(s, 3)) for s in range(6)])
    allowed = torch.randint(0, 256, (2, -(-vocab // 8)), generator=generator, dtype=torch.uint8)
    mask_rows = torch.tensor([0, -1, 1, -1, 0, 1])
    for mask in ((None, None), (allowed, mask_rows)):
        best, index = triton_sampling.block_maxima(logits, temps, keys, *mask, block=block)
        want_best, want_index = reference_maxima(logits, temps, keys, *mask, block=block)
        assert torch.allclose(best, want_best, rtol=4e-16, atol=1e-14), (best - want_best).abs().max()
        assert torch.equal(index, want_index)
print("examples", len(checked), "rows", sum(checked))
"""


def reference_maxima(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                     allowed: torch.Tensor | None, mask_rows: torch.Tensor | None, *,
                     block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_sampling.block_maxima`` from torch ops on the logits' device: the torch path's scores
    (``gumbel_noise + logits / temperature`` in float64; greedy rows: the logits), masked tokens -inf."""
    from gemmaserve.torch_sampling import allowed_on_device, gumbel_noise

    n, vocab = logits.shape
    keys64 = logits.to(torch.float64)
    if allowed is not None:
        ok = allowed_on_device([bytes(line.tolist()) for line in allowed.cpu()], vocab, logits.device)
        masked = mask_rows >= 0
        keys64[masked] = keys64[masked].masked_fill(~ok[mask_rows[masked]], float("-inf"))
    score = gumbel_noise(keys[:, None], vocab)
    score += keys64 / temperatures[:, None]
    score = torch.where((temperatures > 0)[:, None], score, keys64)
    padded = torch.full((n, -(-vocab // block) * block), float("-inf"), dtype=torch.float64, device=logits.device)
    padded[:, :vocab] = score
    best, at = padded.view(n, -1, block).max(dim=-1)  # ties: the first (lowest) id in each block
    start = torch.arange(0, padded.shape[1], block, device=logits.device)
    return best, (at + start).to(torch.int32)


def test_the_kernel_picks_the_definitions_token_under_the_interpreter() -> None:
    """Hypothesis over batches of 1-7 rows (greedy and sampled, temperatures 1e-30 to 1e6, -inf entries, all
    -inf rows, masks full / shorter / longer than the vocabulary / empty, bans, biases) at vocabularies 1, 37,
    300, 1000 and blocks 32-512 and the default: the kernel's tokens are ``sample_tokens``' and the definition's.
    """
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    derandomize = "0" if os.environ.get("GEMMASERVE_HYPOTHESIS_RANDOM") == "1" else "1"
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, "60", derandomize, str(Path(__file__).parent)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "examples 60" in proc.stdout, proc.stdout


def test_the_kernel_compiles_for_hopper_without_a_gpu() -> None:
    """The sm_90 build (the path the interpreter never takes) for every logits dtype, masked and not: the
    float64 log is libdevice's ``__nv_log`` (torch's CUDA float64 ``log``), the division IEEE ``div.rn.f64``,
    no fast approximate log, and the shifts logical."""
    sys.path.insert(0, str(Path(__file__).parent / "custom_torch"))
    from hopper_compile import compile_for_hopper, require_hopper_compiler

    require_hopper_compiler()
    from gemmaserve import triton_sampling as ts
    from gemmaserve.engine.sampling_cpu import SPLITMIX_GAMMA, SPLITMIX_MIX

    (shift1, mul1), (shift2, mul2), (shift3, _) = SPLITMIX_MIX
    for dtype in ("bf16", "fp16", "fp32", "fp64"):
        for has_mask in (False, True):
            signature = {"logits_ptr": f"*{dtype}", "stride_row": "i32", "temps_ptr": "*fp64", "keys_ptr": "*i64",
                         "mask_ptr": "*u8", "mask_rows_ptr": "*i64", "mask_stride": "i32", "best_ptr": "*fp64",
                         "index_ptr": "*i32", "vocab": "i32", "n_blocks": "i32", "HAS_MASK": "constexpr",
                         "BLOCK": "constexpr", "GAMMA": "constexpr", "SHIFT1": "constexpr", "MUL1": "constexpr",
                         "SHIFT2": "constexpr", "MUL2": "constexpr", "SHIFT3": "constexpr"}
            constexprs = {"HAS_MASK": has_mask, "BLOCK": 1024, "GAMMA": SPLITMIX_GAMMA, "SHIFT1": shift1,
                          "MUL1": mul1, "SHIFT2": shift2, "MUL2": mul2, "SHIFT3": shift3}
            asm = compile_for_hopper(ts._block_kernel, signature, constexprs,
                                     unaligned=("stride_row", "mask_stride", "vocab", "n_blocks"))
            assert "__nv_log" in asm["llir"] and "div.rn.f64" in asm["ptx"], dtype
            assert "lg2.approx" not in asm["ptx"] and "shr.s64" not in asm["ptx"], dtype
    compile_for_hopper(ts._combine_kernel, {"best_ptr": "*fp64", "index_ptr": "*i32", "out_ptr": "*i64",
                                            "n_blocks": "i32", "BLOCKS": "constexpr"}, {"BLOCKS": 1024},
                       unaligned=("n_blocks",))


def _rows(n: int, vocab: int, variant: int) -> list[RowSampling]:
    """Sampled rows at several temperatures, every fifth greedy; variant 1 adds masks (some shorter than the
    vocabulary, one empty) and bans, variant 2 a logit_bias on some rows, variant 3 is variant 1 all greedy."""
    rows = []
    for i in range(n):
        temperature = 0.0 if variant == 3 or i % 5 == 4 else (0.3, 0.8, 1.0, 1.7, 1e-4, 50.0)[i % 6]
        allowed = None
        if variant in (1, 3) and i % 3 != 2:
            allowed = b"" if i % 7 == 6 else random.Random(i).randbytes(vocab // 8 - i)
        bias = ((i, 30.0), (vocab - 1 - i, 5.0)) if variant == 2 and i % 2 else ()
        rows.append(RowSampling(temperature, 1.0, 0, 1000 * variant + i, i % 9, allowed=allowed,
                                banned=(i, 2 * i + 1) if variant in (1, 3) else (), logit_bias=bias))
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_tokens_are_the_torch_paths() -> None:
    """262,144-token bf16 logits, 1 / 7 / 64 / 256 rows, plain, masked + banned and biased batches with greedy
    rows mixed in: the fused kernel's tokens equal the torch path's exactly, without a host sync; every block's
    best score equals torch's float64 score bit for bit; captured in a CUDA graph and replayed on new logits,
    the same tokens as eager and as the torch path."""
    from gemmaserve import triton_sampling

    vocab = 262_144
    generator = torch.Generator().manual_seed(3)
    for n in (1, 7, 64, 256):
        logits = (torch.randn(n, vocab, generator=generator) * 3).to(torch.bfloat16).cuda()
        for variant in (0, 1, 2, 3):
            rows = _rows(n, vocab, variant)
            want, _ = sample_on_device(logits, rows, fused=False)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got, _ = sample_on_device(logits, rows)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(got, want), (n, variant, (got != want).nonzero().flatten().tolist()[:10])

    n = 64
    logits = (torch.randn(n, vocab, generator=generator) * 3).to(torch.bfloat16).cuda()
    temperatures = [0.0 if i % 5 == 4 else 0.5 + i / 32 for i in range(n)]
    masks = [random.Random(-m).randbytes(vocab // 8) for m in range(3)]
    rows = [RowSampling(t, 1.0, 0, i, 7, allowed=masks[i % 4 - 1] if i % 4 else None)
            for i, t in enumerate(temperatures)]
    temps = torch.tensor(temperatures, dtype=torch.float64).cuda()
    keys = torch.tensor([_signed64(sampling_seed(row.seed, row.step)) for row in rows]).cuda()
    allowed = torch.tensor([list(mask) for mask in masks], dtype=torch.uint8).cuda()
    mask_rows = torch.tensor([i % 4 - 1 for i in range(n)]).cuda()
    for block in (256, None):  # every block's best score bit for bit (the same libdevice log as torch's)
        best, index = triton_sampling.block_maxima(logits, temps, keys, allowed, mask_rows, block=block)
        want_best, want_index = reference_maxima(logits, temps, keys, allowed, mask_rows,
                                                 block=block or triton_sampling.choose_block(n, vocab))
        assert torch.equal(best, want_best) and torch.equal(index, want_index), block
    eager = triton_sampling.gumbel_argmax(logits, temps, keys, allowed, mask_rows)
    assert torch.equal(eager, sample_on_device(logits, rows, fused=False)[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_sampling.gumbel_argmax(logits, temps, keys, allowed, mask_rows)
    graph.replay()
    assert torch.equal(captured, eager)
    logits.copy_((torch.randn(n, vocab, generator=generator) * 3).to(torch.bfloat16).cuda())
    graph.replay()
    assert torch.equal(captured, sample_on_device(logits, rows, fused=False)[0])
