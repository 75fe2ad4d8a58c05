"""HF-format KV: which layers of a model store KV (and in what shape), and moving KV between the
core's paged blocks and HF ``DynamicCache`` tensors.

HF side: every *storing* layer holds K and V of shape ``[batch, kv_heads, seq, head_dim]``; layers
that reuse another layer's KV (Gemma 4's KV-shared layers) hold a ``DummyLayer`` and store nothing (transformers
before 5.23 has no ``DummyLayer``: its caches end before the shared layers, which are always the last ones).
Every storing layer keeps all positions here, sliding-window layers included, so a cache position always means
the same token for every layer: that is what makes left padding, row splicing and prefix blocks exact. A
sliding-window layer (where transformers' own cache has a ``DynamicSlidingWindowLayer``) is a
:class:`WindowedLayer`: it keeps everything but attends, as transformers' sliding cache does, over the window's last
keys only (and tells the mask so), so a forward rounds as ``generate``'s does (bf16 ``sdpa`` over all positions with
the old ones masked summed differently).

Block side: per storing layer, a K pool and a V pool of shape ``[num_blocks, block_size, kv_heads,
head_dim]`` (each layer with its own head dim and head count). Token ``t`` of a cached sequence lives
in block ``block_ids[t // block_size]`` at slot ``t % block_size``. Copies in both directions are one
``index_select`` / ``index_copy_`` per layer and direction over flat slot indices.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

try:
    from transformers.cache_utils import DummyLayer
except ImportError:  # transformers < 5.23: a cache holds no layer for the KV-shared tail
    DummyLayer = None

from gemmaserve.errors import WINDOW_OF_ONE, ConfigurationError, ModelLoadError

if TYPE_CHECKING:
    from gemmaserve.kv.cache_manager import BlockWrite

__all__ = ["LayerShape", "WindowedLayer", "CacheLayout", "BlockPools", "detect_layout", "storing_layers",
           "set_layer_kv"]

_STORING_LAYER_TYPES = (DynamicLayer, DynamicSlidingWindowLayer)


@dataclass(frozen=True, slots=True)
class LayerShape:
    """A layer that stores its own KV: its index in the model, its per-token K/V shape, and its sliding window
    (None: full attention)."""

    layer_idx: int
    kv_heads: int
    head_dim: int
    window: int | None = None


class WindowedLayer(DynamicLayer):
    """A sliding-window layer's KV that keeps every position (see the module docstring) while each forward attends,
    as transformers' ``DynamicSlidingWindowLayer`` does, over the last ``window - 1`` cached positions plus the new
    ones: :meth:`update` returns those (contiguous, as transformers' concatenation is), :meth:`get_mask_sizes`
    gives the mask their length and offset (the offset indexes a full-length 2-D attention mask)."""

    is_sliding = True

    def __init__(self, window: int) -> None:
        super().__init__()
        self.sliding_window = window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        visible = self.sliding_window - 1 + key_states.shape[-2]
        if keys.shape[-2] <= visible:
            return keys, values
        return keys[:, :, -visible:].contiguous(), values[:, :, -visible:].contiguous()

    def get_mask_sizes(self, query_length: int, *args: object) -> tuple[int, int]:
        past = self.get_seq_length()
        if past >= self.sliding_window:
            return self.sliding_window - 1 + query_length, past - self.sliding_window + 1
        return past + query_length, 0


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Per-layer KV layout of one model: ``stored`` lists the storing layers in layer order; every
    other layer index below ``num_layers`` stores nothing (reuses another layer's KV)."""

    num_layers: int
    stored: tuple[LayerShape, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def cache_layers(self) -> int:
        """How many layers a cache of this layout holds: all of them, or (transformers < 5.23) up to the last
        storing one."""
        if DummyLayer is not None or not self.stored:
            return self.num_layers
        return self.stored[-1].layer_idx + 1

    def new_cache(self) -> DynamicCache:
        """An empty cache: a ``DynamicLayer`` per storing layer (a :class:`WindowedLayer` for a sliding one), a
        ``DummyLayer`` elsewhere."""
        windows = {shape.layer_idx: shape.window for shape in self.stored}
        cache = DynamicCache()
        cache.layers = [(DynamicLayer() if windows[i] is None else WindowedLayer(windows[i])) if i in windows
                        else DummyLayer() for i in range(self.cache_layers)]
        cache.layer_class_to_replicate = None  # the layer list is complete; never grow it
        return cache

    def layer_tensors(self, cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) of every storing layer of ``cache``, in ``stored`` order (not copies)."""
        result = []
        for shape in self.stored:
            layer = cache.layers[shape.layer_idx]
            if not layer.is_initialized or layer.keys is None or layer.keys.ndim != 4:
                raise RuntimeError(f"cache layer {shape.layer_idx} holds no KV tensors")
            result.append((layer.keys, layer.values))
        return result

    def cache_from_tensors(self, tensors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
        """A cache holding ``tensors`` (one (keys, values) pair per storing layer, not copied)."""
        assert len(tensors) == len(self.stored)
        cache = self.new_cache()
        for shape, (keys, values) in zip(self.stored, tensors):
            set_layer_kv(cache.layers[shape.layer_idx], keys, values)
        return cache

    def empty_tensors(self, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero K/V of shape [batch, kv_heads, seq, head_dim] for every storing layer."""
        return [
            (
                torch.zeros(batch, s.kv_heads, seq, s.head_dim, dtype=self.dtype, device=self.device),
                torch.zeros(batch, s.kv_heads, seq, s.head_dim, dtype=self.dtype, device=self.device),
            )
            for s in self.stored
        ]

    def check_cache(self, cache: DynamicCache, batch: int, seq: int) -> None:
        """Raise RuntimeError unless every storing layer of ``cache`` is [batch, H, seq, D] in the
        layout's dtype/device and every other layer is a DummyLayer."""
        if len(cache.layers) != self.cache_layers:
            raise RuntimeError(f"cache has {len(cache.layers)} layers, layout has {self.cache_layers}")
        storing = {shape.layer_idx for shape in self.stored}
        for index, layer in enumerate(cache.layers):
            if index not in storing and not (DummyLayer is not None and isinstance(layer, DummyLayer)):
                raise RuntimeError(f"layer {index} reuses another layer's KV but holds a {type(layer).__name__}")
        for shape, (keys, values) in zip(self.stored, self.layer_tensors(cache)):
            expected = (batch, shape.kv_heads, seq, shape.head_dim)
            for name, tensor in (("keys", keys), ("values", values)):
                if tuple(tensor.shape) != expected or tensor.dtype != self.dtype:
                    raise RuntimeError(
                        f"layer {shape.layer_idx} {name}: {tuple(tensor.shape)} {tensor.dtype}, expected "
                        f"{expected} {self.dtype}"
                    )


def set_layer_kv(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``layer`` hold exactly ``keys`` / ``values`` (no copy). Mutates ``layer``."""
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys = keys
    layer.values = values


def storing_layers(text_config: object) -> list[bool]:
    """For each decoder layer, whether it stores its own KV (see :func:`_cache_layers`)."""
    return [stores for stores, _ in _cache_layers(text_config)]


def _cache_layers(text_config: object) -> list[tuple[bool, int | None]]:
    """For each decoder layer, from the cache transformers would build for ``text_config``: whether it stores its
    own KV, and the window of its ``DynamicSlidingWindowLayer`` (None: another layer). Raises ModelLoadError for
    cache layers this backend cannot manage (linear-attention / recurrent state, quantized or indexed caches)."""
    reference = DynamicCache(config=text_config)
    if not reference.layers:  # lazily-built cache: one plain layer per decoder layer
        return [(True, None)] * int(getattr(text_config, "num_hidden_layers"))
    result: list[tuple[bool, int | None]] = []
    for index, layer in enumerate(reference.layers):
        if DummyLayer is not None and isinstance(layer, DummyLayer):
            result.append((False, None))
        elif type(layer) in _STORING_LAYER_TYPES:
            if getattr(layer, "sliding_window", None) == 1:
                raise ModelLoadError(
                    f"unsupported configuration for the hf backend: decoder layer {index} has sliding_window=1; "
                    f"{WINDOW_OF_ONE}")
            sliding = isinstance(layer, DynamicSlidingWindowLayer)
            result.append((True, int(layer.sliding_window) if sliding else None))
        else:
            raise ModelLoadError(
                f"unsupported architecture for the hf backend: decoder layer {index} uses cache layer "
                f"{type(layer).__name__}; only attention layers with a plain or sliding-window KV cache "
                "(DynamicLayer / DynamicSlidingWindowLayer) are supported"
            )
    num_layers = int(getattr(text_config, "num_hidden_layers", len(result)))
    return result + [(False, None)] * (num_layers - len(result))  # transformers < 5.23: no KV-shared tail layers


FORWARD_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)
"""What a model's forward raises when it cannot run the way the backend calls it (shapes, arguments, cache kind)."""


def forward_failed(what: str, exc: BaseException) -> ModelLoadError:
    """The load-time refusal of a model whose ``what`` (a test forward) raised ``exc``, naming its first line."""
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return ModelLoadError(f"unsupported architecture for the hf backend: {what} failed ({type(exc).__name__}: {first})")


def detect_layout(
    text_config: object, probe_forward: Callable[[DynamicCache], None], *, dtype: torch.dtype, device: torch.device,
    probe_tokens: int,
) -> CacheLayout:
    """Find the model's KV layout: which layers store KV (from the config) and their K/V shapes
    (from one probe forward ``probe_forward(cache)`` of ``probe_tokens`` tokens over an empty layout cache). A
    layer that holds another number of positions afterwards (a model that prepends its own, or keeps a cache of
    another kind under a ``cache`` argument) is a ModelLoadError: every position must be one token."""
    layers = _cache_layers(text_config)
    stores, windows = [stores for stores, _ in layers], [window for _, window in layers]
    provisional = CacheLayout(
        len(stores), tuple(LayerShape(i, 0, 0) for i, s in enumerate(stores) if s), dtype, device
    )
    cache = provisional.new_cache()
    try:
        probe_forward(cache)
    except FORWARD_ERRORS as exc:
        raise forward_failed(f"a {probe_tokens}-token test forward", exc) from exc
    shapes = []
    for shape in provisional.stored:
        layer = cache.layers[shape.layer_idx]
        if not layer.is_initialized or layer.keys is None or layer.keys.ndim != 4:
            raise ModelLoadError(
                f"unsupported architecture for the hf backend: layer {shape.layer_idx} should store KV but "
                "wrote none during a test forward"
            )
        if layer.keys.shape[2] != probe_tokens:
            raise ModelLoadError(
                f"unsupported architecture for the hf backend: layer {shape.layer_idx} holds {layer.keys.shape[2]} "
                f"cached positions after a {probe_tokens}-token test forward (the backend needs one position per "
                "token: the model adds positions of its own or keeps another kind of cache)"
            )
        if layer.keys.shape != layer.values.shape:
            raise ModelLoadError(
                f"unsupported architecture for the hf backend: layer {shape.layer_idx} has K {tuple(layer.keys.shape)}"
                f" and V {tuple(layer.values.shape)} of different shapes"
            )
        shapes.append(LayerShape(shape.layer_idx, int(layer.keys.shape[1]), int(layer.keys.shape[3]),
                                 windows[shape.layer_idx]))
        if layer.keys.dtype != dtype:
            raise ModelLoadError(f"layer {shape.layer_idx} stores KV in {layer.keys.dtype}, model dtype is {dtype}")
    if not shapes:
        raise ModelLoadError("unsupported architecture for the hf backend: no layer stores KV")
    return CacheLayout(len(stores), tuple(shapes), dtype, device)


def _check_room(layout: CacheLayout, num_blocks: int, block_size: int) -> None:
    """Raise ConfigurationError naming PREFIX_CACHE_BLOCKS when the pools need more memory than the device has
    (the host's total RAM on CPU/MPS, free memory on CUDA): allocating them would fail or, on the CPU, get the
    process killed when the zeroed pages are touched."""
    itemsize = torch.empty((), dtype=layout.dtype).element_size()
    need = 2 * num_blocks * block_size * itemsize * sum(shape.kv_heads * shape.head_dim for shape in layout.stored)
    device = torch.device(layout.device)
    if device.type == "cuda":
        room = torch.cuda.mem_get_info(device)[0]
    elif hasattr(os, "sysconf"):
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        return
    if need > room:
        raise ConfigurationError(
            f"the prefix-cache pools (PREFIX_CACHE_BLOCKS={num_blocks} blocks of KV_BLOCK_SIZE={block_size} tokens) "
            f"need {need / 2**30:.1f} GiB for this model but the {device.type} device has {room / 2**30:.1f} GiB "
            f"{'free' if device.type == 'cuda' else 'in all'}; lower PREFIX_CACHE_BLOCKS (0 turns the cache off)")


class BlockPools:
    """The K/V tensors behind the core prefix cache: per storing layer, pools of shape
    ``[num_blocks, block_size, kv_heads, head_dim]``. Owned by the backend; only :meth:`write`
    mutates them. Block bookkeeping (which block holds what) is the CacheManager's."""

    def __init__(self, layout: CacheLayout, num_blocks: int, block_size: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        _check_room(layout, num_blocks, block_size)
        for shape in layout.stored:
            dims = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
            self.keys.append(torch.zeros(dims, dtype=layout.dtype, device=layout.device))
            self.values.append(torch.zeros(dims, dtype=layout.dtype, device=layout.device))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def _flat(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.view(self.num_blocks * self.block_size, pool.shape[2], pool.shape[3])

    def read(self, block_ids: Sequence[int], num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of tokens ``[0, num_tokens)`` stored in ``block_ids`` (block k = tokens [k*bs, (k+1)*bs)),
        as new [1, kv_heads, num_tokens, head_dim] tensors per storing layer."""
        assert 0 < num_tokens <= len(block_ids) * self.block_size
        device = self.layout.device
        blocks = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        result = []
        for k_pool, v_pool in zip(self.keys, self.values):
            keys = self._flat(k_pool).index_select(0, slots).permute(1, 0, 2).unsqueeze(0).contiguous()
            values = self._flat(v_pool).index_select(0, slots).permute(1, 0, 2).unsqueeze(0).contiguous()
            result.append((keys, values))
        return result

    def write(self, tensors: Sequence[tuple[torch.Tensor, torch.Tensor]], writes: Sequence[BlockWrite]) -> None:
        """Copy tokens ``[w.token_start, w.token_end)`` of a single-row cache (``tensors``: one
        [1, H, seq, D] (keys, values) pair per storing layer) into block ``w.block_id`` from slot 0,
        for every ``w`` in ``writes``. Mutates the pools."""
        if not writes:
            return
        device = self.layout.device
        positions = torch.cat([torch.arange(w.token_start, w.token_end, device=device) for w in writes])
        slots = torch.cat(
            [w.block_id * self.block_size + torch.arange(w.token_end - w.token_start, device=device) for w in writes]
        )
        assert all(0 < w.token_end - w.token_start <= self.block_size for w in writes)
        for (keys, values), k_pool, v_pool in zip(tensors, self.keys, self.values):
            assert keys.shape[0] == 1 and keys.shape[2] >= writes[-1].token_end
            self._flat(k_pool).index_copy_(0, slots, keys[0].index_select(1, positions).permute(1, 0, 2))
            self._flat(v_pool).index_copy_(0, slots, values[0].index_select(1, positions).permute(1, 0, 2))

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every pool has the layout's shape, dtype and device."""
        if len(self.keys) != len(self.layout.stored) or len(self.values) != len(self.layout.stored):
            raise RuntimeError("BlockPools: one K and one V pool per storing layer expected")
        for shape, keys, values in zip(self.layout.stored, self.keys, self.values):
            dims = (self.num_blocks, self.block_size, shape.kv_heads, shape.head_dim)
            for pool in (keys, values):
                if tuple(pool.shape) != dims or pool.dtype != self.layout.dtype or not pool.is_contiguous():
                    raise RuntimeError(f"BlockPools: layer {shape.layer_idx} pool {tuple(pool.shape)} != {dims}")
