"""Shard rules: which slice of each checkpoint tensor a tensor-parallel rank holds, and the sharded geometry.

One function decides every parameter's slice (:func:`shard_for`); the loader reads exactly that slice from the
safetensors file (``get_slice``), so no rank ever holds a full copy of a sharded weight. The rules (``r`` = rank,
``N`` = world size):

- **Attention heads**: ``q_proj`` rows of heads ``[r·Hq/N, (r+1)·Hq/N)`` (column-parallel), ``o_proj`` the same
  columns (row-parallel; the model all-reduces its output). ``k_proj`` / ``v_proj`` rows of the KV heads those
  query heads read: split when a layer has at least N KV heads, replicated (each rank the one head its query
  heads share) when it has fewer (E2B: one KV head). q/k norms are per head: replicated.
- **MLP**: ``gate_proj`` / ``up_proj`` rows ``[r·I/N, (r+1)·I/N)``, ``down_proj`` those columns (all-reduced).
- **MoE experts**: every expert's intermediate dimension is split like the MLP's: ``gate_up_proj [E, 2I, H]``
  keeps the rank's rows of the gate half and of the up half, ``down_proj [E, H, I]`` those columns; the router is
  replicated, so each rank routes identically and `MoEExperts.forward` runs unchanged on its slice (all-reduced
  after). No rank owns whole experts.
- **MoE experts, expert parallel** (``ENABLE_EXPERT_PARALLEL``, ``TensorParallel.expert_parallel``): instead of the
  width split, rank r holds whole experts ``[r·E/N, (r+1)·E/N)`` (`expert_range`): rows of dim 0 of both
  ``gate_up_proj`` and ``down_proj``. The router is still replicated; each rank computes only the (token, slot)
  pairs routed to its experts, and the same one all-reduce per MoE block sums the ranks' partial outputs.
  Everything else keeps the rules above.
- **Vocabulary** (``embed_tokens``, the PLE table ``embed_tokens_per_layer``, an untied ``lm_head``): rows
  ``[r·ceil(V/N), (r+1)·ceil(V/N))``, zero-padded to ``ceil(V/N)`` rows on every rank so the logits gather is
  one equal-sized collective.
- Everything else (norms, PLE projections and gates, router, ``layer_scalar``) is replicated.
- FP8 ``weight_scale`` (one per output row, ``models.quantization``): the rows of their weight's slice for
  column-parallel weights, all of them for row-parallel and replicated ones. FP8 experts are quantized at load
  (``quantize_fp8``; FP8 expert checkpoints are not loaded), after the shard is read: their ``[E, rows]`` scales
  are computed from, and so belong to, the rank's slice (its experts, or its rows of every expert).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gemmaserve.errors import ConfigurationError

if TYPE_CHECKING:  # models imports this module: no import cycle at run time
    from ..models.config import GemmaTextConfig

__all__ = ["Shard", "check_shardable", "expert_range", "kv_head_range", "read_shard", "shard_config", "shard_for",
           "vocab_range"]

_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_VOCAB_TABLES = ("embed_tokens.weight", "embed_tokens_per_layer.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class Shard:
    """A rank's part of one checkpoint tensor: the index ranges ``ranges`` along ``dim``, concatenated in order,
    then zero-padded along ``dim`` to ``pad_to`` entries (None = no padding)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    pad_to: int | None = None


def _shard_problems(config: GemmaTextConfig, world_size: int, expert_parallel: bool = False) -> list[str]:
    """Every dimension of ``config`` that ``world_size`` ranks cannot split (empty: shardable)."""
    problems: list[str] = []
    heads = config.num_attention_heads
    if heads % world_size:
        problems.append(f"num_attention_heads={heads} is not divisible by {world_size}")
    for kv in sorted(set(config.num_kv_heads)):
        if kv % world_size and world_size % kv:
            problems.append(f"{kv} KV heads can be neither split over nor replicated onto {world_size} ranks "
                            "(one must divide the other)")
    for width in sorted(set(config.mlp_widths)):
        if width % world_size:
            problems.append(f"MLP width {width} is not divisible by {world_size}")
    if config.moe_num_experts and expert_parallel and config.moe_num_experts % world_size:
        problems.append(f"{config.moe_num_experts} experts (num_experts) are not divisible by {world_size} (expert "
                        "parallel gives each rank the same number of whole experts)")
    elif config.moe_num_experts and not expert_parallel and config.moe_intermediate_size % world_size:
        problems.append(f"moe_intermediate_size={config.moe_intermediate_size} is not divisible by {world_size}")
    return problems


def check_shardable(config: GemmaTextConfig, world_size: int, expert_parallel: bool = False) -> None:
    """Raise ConfigurationError naming every dimension of ``config`` that ``world_size`` ranks cannot split, and
    the sizes up to 8 that can; with ``expert_parallel`` also when the model has no MoE experts (any size)."""
    if expert_parallel and not config.moe_num_experts:
        raise ConfigurationError("ENABLE_EXPERT_PARALLEL splits MoE experts over the tensor-parallel ranks, and this "
                                 "model has none (no MoE block): unset ENABLE_EXPERT_PARALLEL "
                                 "(--enable-expert-parallel)")
    problems = _shard_problems(config, world_size, expert_parallel)
    if problems:
        fitting = [size for size in range(1, 9) if not _shard_problems(config, size, expert_parallel)]
        mode = " with ENABLE_EXPERT_PARALLEL" if expert_parallel else ""
        hint = ""
        if config.moe_num_experts and not expert_parallel and not _shard_problems(config, world_size, True):
            hint = "; or set ENABLE_EXPERT_PARALLEL (--enable-expert-parallel), which gives each rank whole experts"
        raise ConfigurationError(
            f"TENSOR_PARALLEL_SIZE={world_size}{mode} cannot shard this model: {'; '.join(problems)}; choose a size "
            f"that splits every dimension named (this model: {', '.join(map(str, fitting))}){hint}"
        )


def shard_config(config: GemmaTextConfig, world_size: int, expert_parallel: bool = False) -> GemmaTextConfig:
    """The geometry one rank's shard computes: its query heads, KV heads (at least one: replicated heads), MLP
    and expert widths (full under ``expert_parallel``: the rank's share of the experts is `expert_range`; the
    router still sees every expert). Vocabulary and hidden size stay global (logits are gathered to the full
    vocabulary)."""
    check_shardable(config, world_size, expert_parallel)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_kv_heads=tuple(max(1, kv // world_size) for kv in config.num_kv_heads),
        mlp_widths=tuple(width // world_size for width in config.mlp_widths),
        moe_intermediate_size=config.moe_intermediate_size // (1 if expert_parallel else world_size),
    )


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first, end) of the experts ``rank`` holds under expert parallel: a contiguous ``num_experts / N``."""
    per_rank = num_experts // world_size
    return rank * per_rank, (rank + 1) * per_rank


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(first row, end row, padded rows per rank) of ``rank``'s vocabulary slice; end - first may be < padded."""
    per_rank = -(-vocab_size // world_size)
    start = min(vocab_size, rank * per_rank)
    return start, min(vocab_size, start + per_rank), per_rank


def kv_head_range(num_kv_heads: int, num_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """The KV heads ``rank``'s query heads read: its ``num_kv_heads / N`` heads when they split, else the one
    head shared by its ``num_heads / N`` query heads (replicated across ``N / num_kv_heads`` ranks)."""
    if num_kv_heads >= world_size:
        per_rank = num_kv_heads // world_size
        return rank * per_rank, (rank + 1) * per_rank
    first_query = rank * (num_heads // world_size)
    head = first_query // (num_heads // num_kv_heads)
    return head, head + 1


def shard_for(name: str, config: GemmaTextConfig, rank: int, world_size: int,
              expert_parallel: bool = False) -> Shard | None:
    """The slice of parameter ``name`` (the model's name, e.g. ``layers.3.mlp.down_proj.weight``) that ``rank``
    holds, for the unsharded ``config``; None = the whole tensor (replicated). ``expert_parallel``: MoE experts
    split whole (see the module docstring)."""
    if name in _VOCAB_TABLES:
        vocab = config.ple_vocab_size if name.startswith("embed_tokens_per_layer") else config.vocab_size
        start, end, padded = vocab_range(vocab, rank, world_size)
        return Shard(0, ((start, end),), padded)
    if name.endswith(".weight_scale"):  # FP8 per-output-channel scales [out] follow their weight's rows
        weight = shard_for(name.removesuffix("_scale"), config, rank, world_size, expert_parallel)
        return weight if weight is not None and weight.dim == 0 else None
    match = _LAYER_KEY.fullmatch(name)
    if match is None:
        return None
    layer, rest = int(match.group(1)), match.group(2)
    head_dim = config.head_dims[layer]
    heads = config.num_attention_heads // world_size
    if rest in ("self_attn.q_proj.weight", "self_attn.o_proj.weight"):
        span = (rank * heads * head_dim, (rank + 1) * heads * head_dim)
        return Shard(0 if rest.startswith("self_attn.q") else 1, (span,))
    if rest in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        first, end = kv_head_range(config.num_kv_heads[layer], config.num_attention_heads, rank, world_size)
        return Shard(0, ((first * head_dim, end * head_dim),))
    width = config.mlp_widths[layer] // world_size
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return Shard(0, ((rank * width, (rank + 1) * width),))
    if rest == "mlp.down_proj.weight":
        return Shard(1, ((rank * width, (rank + 1) * width),))
    if expert_parallel and rest in ("experts.gate_up_proj", "experts.down_proj"):  # [E, ...]: whole experts
        return Shard(0, (expert_range(config.moe_num_experts, rank, world_size),))
    expert_width = config.moe_intermediate_size // world_size
    own = (rank * expert_width, (rank + 1) * expert_width)
    if rest == "experts.gate_up_proj":  # [E, 2I, H]: gate rows first, then up rows
        full = config.moe_intermediate_size
        return Shard(1, (own, (full + own[0], full + own[1])))
    if rest == "experts.down_proj":  # [E, H, I]
        return Shard(2, (own,))
    return None


def read_shard(handle: Any, key: str, shard: Shard | None) -> Tensor:
    """``key`` from an open safetensors file (``safe_open``), reading only ``shard``'s slices (all of it when None)."""
    if shard is None:
        return handle.get_tensor(key)
    source = handle.get_slice(key)
    rank = len(source.get_shape())
    parts = []
    for start, end in shard.ranges:
        index: list[slice] = [slice(None)] * rank
        index[shard.dim] = slice(start, end)
        parts.append(source[tuple(index)])
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
    if shard.pad_to is not None and tensor.shape[shard.dim] < shard.pad_to:
        pad_shape = list(tensor.shape)
        pad_shape[shard.dim] = shard.pad_to - tensor.shape[shard.dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=shard.dim)
    return tensor
