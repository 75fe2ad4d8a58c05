"""The sort-free Gumbel-max draw of the sampling definition (``gemmaserve.engine.sampling_cpu``) as one fused
Triton pass over the logits, for :func:`gemmaserve.torch_sampling.sample_on_device` on CUDA.

Imported only by ``gemmaserve.torch_sampling`` when it runs on CUDA (``import gemmaserve`` never imports it,
nor torch or triton). :func:`gumbel_argmax` reads every logit once in its own dtype and computes, per token,
what ``torch_sampling`` computes in ~15 full-vocabulary float64 / int64 passes: SplitMix64 of (row key, id) in
uint64, ``u = ((bits >> 11) + 0.5) * 2**-53``, ``g = -log(-log(u))`` and ``float64(logit) / temperature + g``
in float64 (the same operations in the same order, so the same float64 values where ``log`` is the same
function: libdevice's on CUDA, as torch's float64 ``log``), masked tokens and -inf logits at -inf, then the
argmax with ties to the lowest id in two stages (a partial max and its first index per ``BLOCK`` ids, then
one program per row over the partials; so one row still spreads over the GPU). Rows with temperature 0 are
greedy: the argmax of the (masked) logits, as ``torch.argmax`` picks it. A row with no finite candidate gives
token 0, as ``torch.argmax`` over an all -inf row does. NaN logits: unspecified.

No host sync; launch grids depend on shapes only, so the call is CUDA-graph capturable. Runs on CPU tensors
under ``TRITON_INTERPRET=1`` (numpy float64 / uint64) for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmaserve.engine.sampling_cpu import SPLITMIX_GAMMA, SPLITMIX_MIX

__all__ = ["block_maxima", "choose_block", "gumbel_argmax"]

#: Programs to aim for: about eight per SM of an H200 (132 SMs), so that even one row keeps the GPU busy.
TARGET_PROGRAMS = 1024
#: The largest block: 1024 ids over 4 warps take 72 registers a thread at sm_90 (4096: 192, a third of the
#: occupancy for a kernel bound by float64 arithmetic).
MAX_BLOCK = 1024

_NONE = tl.constexpr(2**31 - 1)  # an index past every vocabulary: loses every tie


@triton.jit
def _block_kernel(logits_ptr, stride_row, temps_ptr, keys_ptr, mask_ptr, mask_rows_ptr, mask_stride, best_ptr,
                  index_ptr, vocab, n_blocks, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, GAMMA: tl.constexpr,
                  SHIFT1: tl.constexpr, MUL1: tl.constexpr, SHIFT2: tl.constexpr, MUL2: tl.constexpr,
                  SHIFT3: tl.constexpr):
    """Program (row, block): the largest score of ids ``[block * BLOCK, (block + 1) * BLOCK)`` and its lowest
    id, into ``best[row, block]`` (float64) and ``index[row, block]`` (int32)."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    ids = block * BLOCK + tl.arange(0, BLOCK)
    inside = ids < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=inside, other=float("-inf")).to(tl.float64)
    if HAS_MASK:
        mask_row = tl.load(mask_rows_ptr + row)
        if mask_row >= 0:  # bit (id & 7) of byte id >> 3 set = allowed
            byte = tl.load(mask_ptr + mask_row * mask_stride + (ids >> 3), mask=inside, other=0)
            allowed = ((byte >> (ids & 7).to(tl.uint8)) & 1) != 0
            x = tl.where(allowed, x, float("-inf"))
    temperature = tl.load(temps_ptr + row)
    if temperature > 0:
        key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
        z = key + (ids.to(tl.uint64) + 1) * GAMMA  # uint64: wraps modulo 2**64
        z = (z ^ (z >> SHIFT1)) * MUL1
        z = (z ^ (z >> SHIFT2)) * MUL2
        z = z ^ (z >> SHIFT3)
        u = ((z >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53, exact in float32 too
        score = x / temperature + -tl.log(-tl.log(u))
    else:
        score = x
    best = tl.max(score, axis=0)
    index = tl.min(tl.where(score == best, ids, _NONE), axis=0)  # an all -inf block: its first id
    tl.store(best_ptr + row * n_blocks + block, best)
    tl.store(index_ptr + row * n_blocks + block, index)


@triton.jit
def _combine_kernel(best_ptr, index_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    """Program row: the lowest id among the blocks' winners with the largest score, into ``out[row]`` (int64)."""
    row = tl.program_id(0)
    at = tl.arange(0, BLOCKS)
    inside = at < n_blocks
    best = tl.load(best_ptr + row * n_blocks + at, mask=inside, other=float("-inf"))
    index = tl.load(index_ptr + row * n_blocks + at, mask=inside, other=_NONE)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, index, _NONE), axis=0).to(tl.int64))


def choose_block(rows: int, vocab: int) -> int:
    """Ids per program: the largest power of two in [256, MAX_BLOCK] giving at least TARGET_PROGRAMS programs
    (256 when none does). Shapes only."""
    block = MAX_BLOCK
    while block > 256 and rows * triton.cdiv(vocab, block) < TARGET_PROGRAMS:
        block //= 2
    return block


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                  allowed: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None, *,
                  block: int | None = None) -> torch.Tensor:
    """The definition's token per row, int64 [n] on the logits' device (no host sync).

    - ``logits`` [n, vocab]: bfloat16 / float16 / float32 / float64 (read in their own dtype, widened to
      float64; already adjusted for ``logit_bias`` / penalties / ``banned`` where a row has them).
    - ``temperatures`` float64 [n]: > 0 samples; 0 is greedy (argmax of the masked logits).
    - ``keys`` int64 [n]: ``sampling_seed(seed, step)``'s 64 bits (``torch_sampling._signed64``).
    - ``allowed`` uint8 [m, ceil(vocab / 8)] packed masks (bit ``j`` of byte ``b``: token ``8b + j`` allowed)
      with ``mask_rows`` int64 [n]: row ``r`` uses ``allowed[mask_rows[r]]``, or no mask when it is negative.
    - ``block``: ids per program (a power of two; default :func:`choose_block`).
    """
    best, index = block_maxima(logits, temperatures, keys, allowed, mask_rows, block=block)
    n, n_blocks = best.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n > 0:
        _combine_kernel[(n,)](best, index, tokens, n_blocks, BLOCKS=triton.next_power_of_2(n_blocks), num_warps=4)
    return tokens


def block_maxima(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                 allowed: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None, *,
                 block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gumbel_argmax`'s first stage (same arguments): float64 [n, cdiv(vocab, block)] the largest score
    of each block of ids (-inf where none is finite), int32 the same shape its lowest id."""
    n, vocab = logits.shape
    if temperatures.shape != (n,) or keys.shape != (n,) or (allowed is None) != (mask_rows is None):
        raise ValueError("temperatures and keys must be [rows]; allowed and mask_rows come together")
    if allowed is not None and (allowed.dim() != 2 or allowed.shape[1] < triton.cdiv(vocab, 8)
                                or allowed.dtype != torch.uint8 or mask_rows.shape != (n,)):
        raise ValueError(f"allowed must be uint8 [masks, {triton.cdiv(vocab, 8)}], mask_rows [{n}]")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = block or choose_block(n, vocab)
    n_blocks = triton.cdiv(vocab, block)
    best = torch.empty((n, n_blocks), dtype=torch.float64, device=logits.device)
    index = torch.empty((n, n_blocks), dtype=torch.int32, device=logits.device)
    if n == 0:
        return best, index
    (shift1, mul1), (shift2, mul2), (shift3, last) = SPLITMIX_MIX
    assert last == 1  # the finalizer ends with a plain xor-shift
    has_mask = allowed is not None
    _block_kernel[(n, n_blocks)](
        logits, logits.stride(0), temperatures, keys, allowed if has_mask else keys,
        mask_rows if has_mask else keys, allowed.stride(0) if has_mask else 0, best, index, vocab, n_blocks,
        HAS_MASK=has_mask, BLOCK=block, GAMMA=SPLITMIX_GAMMA, SHIFT1=shift1, MUL1=mul1, SHIFT2=shift2, MUL2=mul2,
        SHIFT3=shift3, num_warps=4)
    return best, index
