"""The sampling definition (``gemmaserve.engine.sampling_cpu``) in torch, for every torch backend.

Imported only by the torch backends (``import gemmaserve`` never imports it, nor torch):

- first ``logit_bias`` is added, the penalties applied, ``banned`` tokens and tokens outside the ``allowed``
  mask (structured output) set to -inf (:func:`adjust_logits`).
- ``temperature == 0``: argmax (lowest index wins a tie).
- otherwise: logits / temperature, keep the ``top_k`` largest (0 = all), then the smallest most-likely prefix
  whose probability reaches ``top_p`` (ties: lower index first), then those at least ``min_p`` times as likely
  as the most likely, and pick the kept token with the largest ``scaled + g`` (ties: lowest id), ``g`` the
  definition's per-token Gumbel noise of (``sampling_seed(seed, step)``, token id) (:func:`gumbel_noise`: the
  same 53-bit integers as ``sampling_cpu.noise_bits``, computed with wrapping int64 ops, then float64). So a
  row's token is a pure function of its logits and (seed, step), whatever else is in the batch and whichever
  backend runs it, and matches the pure-Python definition up to float rounding (float64 here; on MPS the noise
  is computed on the CPU in float64 and the score summed in float32). When no row uses top_k / top_p / min_p
  there is no sort: one argmax over the vocabulary in id order; on CUDA, when triton imports, that case (no
  row with top_k / top_p / min_p, no logprobs) is one fused Triton pass instead
  (:func:`gemmaserve.triton_sampling.gumbel_argmax`: the same float64 arithmetic, the ``allowed`` masks read
  packed, greedy rows of the batch in the same launch).
- logprob: the chosen token's ``log_softmax`` under the adjusted (unscaled, unfiltered) distribution.

Vectorised over rows. :func:`sample_on_device` leaves the tokens (and logprobs) on the device without a host
sync (its small host-to-device copies go through pinned memory on CUDA), for asynchronous decode;
:func:`sample_tokens` reads them back (one sync). All-greedy calls without logprobs skip the float64 copy.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from types import ModuleType

import torch

from gemmaserve.backend import SampledTokens
from gemmaserve.engine.sampling_cpu import SPLITMIX_GAMMA, SPLITMIX_MIX, penalty_offset, sampling_seed
from gemmaserve.sampling_params import RowSampling
from gemmaserve.structured.grammar import mask_rows_span

__all__ = ["adjust_logits", "gumbel_noise", "host_to_device", "mask_logits", "noise_bits", "pinned_mask_memory",
           "sample_on_device", "sample_tokens", "sampled_from_host", "to_device"]


def to_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device`` without waiting for the device: on CUDA through pinned memory with a
    non-blocking copy (the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype).to(device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor ``host`` on ``device`` without waiting for queued device work. On CUDA it is copied into a
    fresh pinned buffer from the caching host allocator (kept until the non-blocking copy ran), not through
    ``Tensor.pin_memory()``, whose pinned-pointer query cost ~0.1 ms of host time per call on the H100 (run 25)."""
    if device.type != "cuda":
        return host.to(device)
    return torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host).to(device, non_blocking=True)


def sample_tokens(logits: torch.Tensor, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
    """One token per row of ``logits`` [rows, vocab] (any float dtype, any device). Does not mutate logits."""
    tokens, logprobs = sample_on_device(logits, rows, want_logprobs=want_logprobs)
    return sampled_from_host(tokens.tolist(), None if logprobs is None else logprobs.cpu())


def sampled_from_host(token_ids: list[int], logprobs: torch.Tensor | None) -> SampledTokens:
    """:class:`SampledTokens` from :func:`sample_on_device`'s results on the host (``logprobs`` [rows], or
    [rows, 1 + 2k] with the top alternatives: see there)."""
    if logprobs is None:
        return SampledTokens(token_ids)
    if logprobs.dim() == 1:
        return SampledTokens(token_ids, [float(x) for x in logprobs.tolist()])
    k = (logprobs.shape[1] - 1) // 2
    table = logprobs.tolist()
    top = [[(int(t), float(v)) for t, v in zip(line[1:1 + k], line[1 + k:]) if t >= 0 and v != -math.inf
            and not math.isnan(v)] for line in table]  # NaN: a row whose every token is masked has no alternatives
    return SampledTokens(token_ids, [float(line[0]) for line in table], top)


def sample_on_device(
    logits: torch.Tensor, rows: Sequence[RowSampling], *, want_logprobs: bool = False, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As :func:`sample_tokens`, but returns (token ids int64 [rows], logprobs or None) on the logits' device,
    without a host sync. logprobs: [rows], or [rows, 1 + 2k] when rows want ``top_logprobs`` (see
    :func:`sampled_from_host`, which reads either).

    The full-vocabulary sort (only when a row uses top_k / top_p / min_p) runs on keys in the logits' own dtype
    unless a row's values change (``logit_bias``, penalties): bfloat16 / float16 / float32 values widen exactly
    to float64 and dividing by a positive temperature keeps distinct values distinct, so the order is the float64
    definition's (a 16-bit sort of 64 x 262,144 keys takes ~0.8 ms on an H200, a float64 one ~2 ms). Changed
    values and float64 logits are float64 keys, which can meet once divided: those are sorted scaled (ties to the
    lower id, as the definition's). Masks (``banned``, ``allowed``) are -inf in any dtype.

    ``fused`` (default): on CUDA, calls without logprobs where no row uses top_k / top_p / min_p go through
    :func:`_fused_tokens` (one Triton pass, same tokens) when triton imports; False keeps the torch ops."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, vocab] for {len(rows)} rows, got {tuple(logits.shape)}")
    adjusted = any(row.adjusts_logits for row in rows)
    if not want_logprobs and not adjusted and all(row.is_greedy for row in rows):
        # argmax in the logits' own dtype: widening is exact and monotone, so the pick (ties: lowest index) is
        # the same as in float64, without the [rows, vocab] float64 copy
        return logits.argmax(dim=-1), None
    if fused and not want_logprobs and logits.device.type == "cuda" and _fusable(rows, logits.shape[1]):
        kernels = _triton_sampling()
        if kernels is not None:
            return _fused_tokens(logits, rows, kernels), None
    work_dtype = torch.float32 if logits.device.type == "mps" else torch.float64
    if any(row.logit_bias or row.has_penalties for row in rows):
        keys = mask_logits(_revalue(logits.to(work_dtype, copy=True), rows), rows)
    elif adjusted:
        keys = mask_logits(logits.clone(), rows)
    else:
        keys = logits
    sampled = [i for i, row in enumerate(rows) if not row.is_greedy]
    if len(sampled) == len(rows):
        tokens = _sample_filtered(keys, rows, work_dtype)
    else:
        tokens = keys.argmax(dim=-1)
        if sampled:
            index = to_device(sampled, torch.int64, logits.device)
            tokens[index] = _sample_filtered(keys[index], [rows[i] for i in sampled], work_dtype)
    if not want_logprobs:
        return tokens, None
    return tokens, _logprobs(keys, rows, tokens, work_dtype)


def _fusable(rows: Sequence[RowSampling], vocab: int) -> bool:
    """True when every row is greedy or a plain temperature draw (no top_k below the vocabulary, top_p, min_p)."""
    return all(row.is_greedy or (row.temperature > 0.0 and not 0 < row.top_k < vocab and row.top_p >= 1.0
                                 and row.min_p <= 0.0) for row in rows)


@functools.cache
def _triton_sampling() -> ModuleType | None:
    """:mod:`gemmaserve.triton_sampling`, or None where triton does not import."""
    try:
        from gemmaserve import triton_sampling
    except ImportError:
        return None
    return triton_sampling


def _fused_tokens(logits: torch.Tensor, rows: Sequence[RowSampling], kernels: ModuleType) -> torch.Tensor:
    """The tokens of rows that are greedy or plain temperature draws (:func:`_fusable`) in one
    ``kernels.gumbel_argmax`` launch (``kernels``: :mod:`gemmaserve.triton_sampling`): ``logit_bias`` /
    penalties (a float64 copy) and ``banned`` (a copy) are applied as on the torch path, the ``allowed`` masks
    go to the kernel packed. One host-to-device copy for the row parameters, one more for masks. Any device
    triton runs on (CUDA; CPU under ``TRITON_INTERPRET=1`` for the tests)."""
    (n, vocab), device = logits.shape, logits.device
    if any(row.logit_bias or row.has_penalties for row in rows):
        keys = _ban(_revalue(logits.to(torch.float64, copy=True), rows), rows)
    elif any(row.banned for row in rows):
        keys = _ban(logits.clone(), rows)
    else:
        keys = logits
    masked = [i for i, row in enumerate(rows) if row.allowed is not None]
    mask_rows = [-1] * n
    for at, i in enumerate(masked):
        mask_rows[i] = at
    temperature_bits = torch.tensor([row.temperature for row in rows], dtype=torch.float64).view(torch.int64)
    host = torch.stack([torch.tensor([_signed64(sampling_seed(row.seed, row.step)) for row in rows]),
                        torch.tensor(mask_rows), temperature_bits])  # int64 [3, n]: one copy
    params = host_to_device(host, device)
    allowed = _packed_allowed([rows[i].allowed or b"" for i in masked], vocab, device) if masked else None
    return kernels.gumbel_argmax(keys, params[2].view(torch.float64), params[0], allowed,
                                 params[1] if masked else None)


def _logprobs(keys: torch.Tensor, rows: Sequence[RowSampling], tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The chosen tokens' logprobs [rows]; when a row wants alternatives (k = the largest
    ``RowSampling.top_logprobs``), [rows, 1 + 2k]: the chosen logprob, the k most likely ids (by adjusted logit,
    ties: lower id; -1 past the row's own count) and their logprobs, in ``dtype`` (ids are exact in it)."""
    log_probs = torch.log_softmax(keys.to(dtype), dim=-1)
    chosen = log_probs.gather(1, tokens[:, None])
    k = max(row.top_logprobs for row in rows)
    if k <= 0:
        return chosen[:, 0]
    k = min(k, keys.shape[1])
    order = torch.sort(keys, dim=-1, descending=True, stable=True)[1][:, :k]
    wanted = to_device([row.top_logprobs for row in rows], torch.int64, keys.device)
    ids = torch.where(torch.arange(k, device=keys.device)[None, :] < wanted[:, None], order, -1)
    return torch.cat([chosen, ids.to(dtype), log_probs.gather(1, order)], dim=1)


def adjust_logits(values: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """In place on ``values`` [rows, vocab]: add each row's ``logit_bias``, apply its penalties, set its ``banned``
    tokens and those outside its ``allowed`` mask to -inf (ids beyond the vocabulary are ignored). Returns
    ``values``."""
    return mask_logits(_revalue(values, rows), rows)


def _revalue(values: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """In place: ``logit_bias`` added, then the penalties applied (the adjustments that change values)."""
    vocab = values.shape[1]
    bias_at = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.logit_bias if token < vocab]
    device, dtype = values.device, values.dtype
    if bias_at:
        index = to_device([[i for i, _, _ in bias_at], [t for _, t, _ in bias_at]], torch.int64, device)
        values.index_put_((index[0], index[1]), to_device([b for _, _, b in bias_at], dtype, device), accumulate=True)
    penalized_at = [(i, token, count) for i, row in enumerate(rows) if row.has_penalties
                    for token, count in row.penalized_tokens() if token < vocab]
    if penalized_at:
        index = to_device([[i for i, _, _ in penalized_at], [t for _, t, _ in penalized_at]], torch.int64, device)
        rp = to_device([rows[i].repetition_penalty for i, _, _ in penalized_at], dtype, device)
        offset = to_device([penalty_offset(c, rows[i]) for i, _, c in penalized_at], dtype, device)
        current = values[index[0], index[1]]
        values[index[0], index[1]] = torch.where(current > 0, current / rp, current * rp) - offset
    return values


def mask_logits(values: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """In place: each row's ``banned`` tokens and those outside its ``allowed`` mask set to -inf (any dtype)."""
    vocab = values.shape[1]
    device = values.device
    _ban(values, rows)
    masked = [i for i, row in enumerate(rows) if row.allowed is not None]
    if masked:
        allowed = allowed_on_device([rows[i].allowed or b"" for i in masked], vocab, device)
        if len(masked) == len(rows):
            values.masked_fill_(~allowed, float("-inf"))
        else:
            index = to_device(masked, torch.int64, device)
            values[index] = values[index].masked_fill(~allowed, float("-inf"))
    return values


def _ban(values: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """In place: each row's ``banned`` tokens set to -inf (ids beyond the vocabulary are ignored)."""
    vocab = values.shape[1]
    device = values.device
    banned_at = [(i, token) for i, row in enumerate(rows) for token in row.banned if token < vocab]
    if banned_at:
        index = to_device([[i for i, _ in banned_at], [t for _, t in banned_at]], torch.int64, device)
        # a device-side value: a Python float would be uploaded from pageable memory, a synchronizing copy
        values.index_put_((index[0], index[1]), torch.full((), float("-inf"), dtype=values.dtype, device=device))
    return values


def _packed_allowed(masks: Sequence[bytes | memoryview], vocab: int, device: torch.device) -> torch.Tensor:
    """uint8 [len(masks), ceil(vocab / 8)]: the ``RowSampling.allowed`` bitmasks on ``device``, each cut or
    zero-padded to the vocabulary (tokens past a mask's end are not allowed). Masks that are consecutive rows of
    one batch (``mask_rows_span``: a tick's constrained rows, as the batched mask call laid them out) go as one
    span: from the backend's pinned :func:`pinned_mask_memory` straight to the device (one non-blocking copy), or
    from a ``bytearray`` through one copy into pinned memory (64 masks of Gemma's vocabulary: ~0.24 against
    ~0.62 ms of host time row by row on the development CPU). Otherwise each mask is copied once, straight from
    where it lies, into that host memory."""
    width = -(-vocab // 8)
    span = mask_rows_span(masks, width)
    if span is not None:
        block, offset = span
        count = len(masks) * width
        start = _offset_in_owner(block)
        if start is not None:  # pinned_mask_memory: the copy reads where llguidance wrote
            rows = block.owner[start + offset:start + offset + count]
            return rows.view(len(masks), width).to(device, non_blocking=True, copy=True)
        rows = torch.frombuffer(block, dtype=torch.uint8, count=count, offset=offset)
        if device.type != "cuda":
            return rows.view(len(masks), width).to(device, copy=True)
        staged = torch.empty((len(masks), width), dtype=torch.uint8, pin_memory=True)
        staged.view(-1).copy_(rows)
        return staged.to(device, non_blocking=True)
    packed = torch.empty((len(masks), width), dtype=torch.uint8, pin_memory=device.type == "cuda")
    base = packed.data_ptr()
    for i, mask in enumerate(masks):
        length = min(len(mask), width)
        ctypes.memmove(base + i * width, _address(mask, length), length)
        if length < width:
            ctypes.memset(base + i * width + length, 0, width - length)
    if device.type == "cuda":
        return packed.to(device, non_blocking=True)
    return packed.to(device)


def _offset_in_owner(block: ctypes.Array) -> int | None:
    """Where ``block``'s memory starts in ``block.owner`` when that is a contiguous 1-D uint8 CPU tensor holding all
    of it (what :func:`pinned_mask_memory` gives), else None."""
    owner = block.owner
    if not (isinstance(owner, torch.Tensor) and owner.dtype == torch.uint8 and owner.dim() == 1
            and owner.device.type == "cpu" and owner.is_contiguous()):
        return None
    start = ctypes.addressof(block) - owner.data_ptr()
    return start if 0 <= start and start + len(block) <= owner.numel() else None


def pinned_mask_memory(nbytes: int, device: torch.device) -> tuple[int, torch.Tensor] | None:
    """``InferenceBackend.mask_memory`` of a torch backend sampling on ``device``: on CUDA ``nbytes`` of pinned host
    memory (not zeroed) from torch's caching host allocator, which keeps a block from reuse until the copies
    recorded on it completed, so a batch's masks need no staging copy (64 masks of Gemma's vocabulary: 2 MB) and
    no zero-fill; elsewhere None (the engine's ``bytearray``)."""
    if device.type != "cuda":
        return None
    block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return block.data_ptr(), block


def _address(mask: bytes | memoryview, length: int) -> int | bytes:
    """A source of ``mask``'s first ``length`` bytes for ``ctypes.memmove``: a bytes object itself, a writable
    view's address (the slices :func:`~gemmaserve.structured.grammar.allowed_many` hands out), else a copy."""
    if isinstance(mask, bytes):
        return mask
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mask))
    except (TypeError, ValueError):  # read-only or empty
        return bytes(mask[:length])


def allowed_on_device(masks: Sequence[bytes | memoryview], vocab: int, device: torch.device) -> torch.Tensor:
    """bool [len(masks), vocab]: the ``RowSampling.allowed`` bitmasks unpacked on ``device`` (one small copy;
    tokens past a mask's end are not allowed)."""
    width = -(-vocab // 8)
    packed = _packed_allowed(masks, vocab, device)
    bits = torch.arange(8, dtype=torch.uint8, device=device)
    return ((packed[:, :, None] >> bits) & 1).bool().reshape(len(masks), width * 8)[:, :vocab]


def _sample_filtered(keys: torch.Tensor, rows: Sequence[RowSampling], dtype: torch.dtype) -> torch.Tensor:
    """Temperature / top-k / top-p / min-p sampling of every row of ``keys`` [n, vocab] (sorted in their own
    dtype when a filter is on, the arithmetic in ``dtype``); returns token ids [n]. Filters no row uses are
    skipped; with none, so is the sort."""
    vocab = keys.shape[1]
    device = keys.device
    top_k = [row.top_k if 0 < row.top_k < vocab else vocab for row in rows]
    params = torch.tensor([[row.temperature for row in rows], top_k, [row.top_p for row in rows],
                           [math.log(row.min_p) if row.min_p > 0.0 else -math.inf for row in rows]], dtype=dtype)
    temps, k, top_p, log_min_p = host_to_device(params, device)
    noise_device = torch.device("cpu") if device.type == "mps" else device  # MPS has no float64
    seeds = to_device([[_signed64(sampling_seed(row.seed, row.step))] for row in rows], torch.int64, noise_device)
    score = gumbel_noise(seeds, vocab).to(dtype).to(device)  # becomes scaled + noise
    score += keys.to(dtype) / temps[:, None]  # -inf (banned) stays -inf
    if not any(kk < vocab for kk in top_k) and all(row.top_p >= 1.0 and row.min_p <= 0.0 for row in rows):
        return score.argmax(dim=-1)  # every finite token is kept (an all -inf row gives token 0): no sort
    if keys.dtype == torch.float64:  # changed values (logit_bias, penalties): two may meet once divided, so sort
        ordered, order = torch.sort(keys.to(dtype) / temps[:, None], dim=-1, descending=True, stable=True)
        scaled = ordered  # the scaled values themselves (ties go to the lower id, as the definition's)
    else:  # widened 16/32-bit values stay distinct when divided: their own order is the scaled order
        ordered, order = torch.sort(keys, dim=-1, descending=True, stable=True)
        scaled = ordered.to(dtype) / temps[:, None]
    keep = scaled > float("-inf")  # banned (-inf) tokens can never be drawn
    if any(kk < vocab for kk in top_k):
        keep &= torch.arange(vocab, device=device)[None, :] < k[:, None]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(row.top_p < 1.0 for row in rows):
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each rank
        keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    if any(row.min_p > 0.0 for row in rows):  # a ratio to the most likely token: scaled >= max + log(min_p)
        keep &= scaled >= scaled[:, :1] + log_min_p[:, None]
    keep &= probs > 0  # never the winner anyway: underflow is > 700 below the top, noise spans ~41
    keep[:, 0] = True  # the most likely token always survives (a tiny top_p or rounding must not empty a row)
    kept = torch.zeros_like(keep).scatter_(1, order, keep)  # back to id order
    return score.masked_fill_(~kept, float("-inf")).argmax(dim=-1)  # ties: the lowest id


def _signed64(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def noise_bits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 [n, vocab]: ``sampling_cpu.noise_bits(keys[r], i)`` for every row key (int64 [n, 1], the unsigned
    key's bits) and token id ``i``: SplitMix64's finalizer with int64 arithmetic, which wraps like uint64; a
    logical right shift by ``k`` is the arithmetic one masked to its low ``64 - k`` bits. In place on two
    [n, vocab] buffers (fresh temporaries per op cost ~4x on CPU)."""
    z = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device).mul_(_signed64(SPLITMIX_GAMMA)) + keys
    shifted = torch.empty_like(z)
    for shift, multiplier in SPLITMIX_MIX:
        torch.bitwise_right_shift(z, shift, out=shifted)
        z ^= shifted.bitwise_and_((1 << (64 - shift)) - 1)
        if multiplier != 1:
            z *= _signed64(multiplier)
    return z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [n, vocab]: the definition's Gumbel noise ``-log(-log((bits + 0.5) * 2**-53))`` (see
    :func:`noise_bits`) on ``keys``' device."""
    u = noise_bits(keys, vocab).to(torch.float64).add_(0.5).mul_(2.0**-53)
    return u.log_().neg_().log_().neg_()
