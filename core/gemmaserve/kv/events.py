"""KV-cache events in vLLM's wire format: what the prefix cache stores and drops, for KV-aware routers.

vLLM (``--kv-events-config``) publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events for
its prefix cache on a ZMQ PUB socket; routers such as NVIDIA Dynamo and llm-d subscribe and route each request
to the replica holding most of its prefix. This module speaks the same protocol (see docs/kv-events.md):

- :class:`KVEventsConfig` / :func:`parse_kv_events_config`: vLLM's ``KVEventsConfig`` keys, from JSON.
- :class:`VllmBlockHasher`: vLLM's default block hash (``prefix_caching_hash_algo="sha256"``) and
  :func:`external_block_hash`, the 64-bit int events carry.
- :class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`, :func:`encode_event_batch`: the
  msgpack payload of vLLM 0.24-0.28 (``event_encoding="map"``) or of vLLM <= 0.23 (``"array"``).
- :class:`ZmqEventPublisher`: a :class:`~gemmaserve.kv.radix.RadixObserver` that queues the index's changes
  (cheap, never blocks the engine) and publishes them from its own thread, with vLLM's replay socket.

Importing this module imports neither zmq nor msgpack; the publisher imports them when built.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, Union, runtime_checkable

from gemmaserve.errors import ConfigurationError
from gemmaserve.kv.radix import RadixObserver, StoredBlock

__all__ = [
    "KVEventsConfig",
    "parse_kv_events_config",
    "check_rank_endpoints",
    "VllmBlockHasher",
    "external_block_hash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVCacheEvent",
    "encode_event_batch",
    "KVEventSource",
    "ZmqEventPublisher",
    "offset_endpoint",
    "END_SEQ",
    "MEDIUM_GPU",
]

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
"""vLLM's name for the engine's own KV pool (the device tier), whatever the device: routers drop other media."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame of the replay socket's end-of-replay message (its payload frame is empty)."""
EventEncoding = Literal["map", "array"]


# -- configuration ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (same keys, defaults and meaning) plus ``event_encoding``, a gemmaserve key.

    ``publisher`` None resolves as vLLM's does: ``"zmq"`` when events are enabled, else ``"null"`` (events are
    computed by nobody and published nowhere). ``endpoint``: bound when it holds ``*`` or ``::`` or is
    ``ipc://`` / ``inproc://``, else connected to (vLLM's rule). ``replay_endpoint`` (bound) serves the last
    ``buffer_steps`` batches again on request. ``hwm``: the PUB socket's send high-water mark.
    ``max_queue_size``: changes queued for the publisher thread; beyond it they are dropped and counted.
    ``event_encoding``: ``"map"`` (vLLM >= 0.24: each event a msgpack map with a ``"type"`` key) or
    ``"array"`` (vLLM <= 0.23: each event a positional array, its tag first) for routers that read only that.
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_encoding: EventEncoding = "map"

    @property
    def resolved_publisher(self) -> Literal["null", "zmq"]:
        """``publisher``, or vLLM's default for it: ``"zmq"`` when events are enabled, else ``"null"``."""
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        """True when events are enabled and go to a real (zmq) publisher."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"


_FIELDS = tuple(field.name for field in dataclasses.fields(KVEventsConfig))
_SETTING = "KV_EVENTS_CONFIG"


def parse_kv_events_config(value: object) -> KVEventsConfig | None:
    """``value`` as a :class:`KVEventsConfig`: a JSON object (text, as ``--kv-events-config`` takes it), a
    mapping, a dataclass with those fields (vLLM's own ``KVEventsConfig``) or a :class:`KVEventsConfig`.
    None or blank text: None (no events).

    Raises :class:`ConfigurationError` for text that is not a JSON object, an unknown key (naming it and the
    accepted ones) or a value of the wrong type or range; nothing is ignored silently.
    """
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, (str, bytes)):
        text = value.decode() if isinstance(value, bytes) else value
        if not text.strip():
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(
                f"{_SETTING} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): {text!r}; give "
                'an object such as {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
            ) from None
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{_SETTING} must be a JSON object of vLLM's KVEventsConfig keys, got {value!r}")
    unknown = [key for key in value if key not in _FIELDS]
    if unknown:
        raise ConfigurationError(
            f"{_SETTING}: unknown key {', '.join(repr(key) for key in unknown)}; accepted keys: {', '.join(_FIELDS)}"
        )
    options = dict(value)
    for key in ("enable_kv_cache_events",):
        if key in options and not isinstance(options[key], bool):
            raise ConfigurationError(f"{_SETTING}: {key} must be true or false, got {options[key]!r}")
    if options.get("publisher") not in (None, "null", "zmq"):
        raise ConfigurationError(f"{_SETTING}: publisher must be \"zmq\" or \"null\", got {options['publisher']!r}")
    for key, optional in (("endpoint", False), ("replay_endpoint", True), ("topic", False)):
        if key in options and not (isinstance(options[key], str) or (optional and options[key] is None)):
            raise ConfigurationError(f"{_SETTING}: {key} must be a string, got {options[key]!r}")
    for key, low in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
        number = options.get(key, low)
        if isinstance(number, bool) or not isinstance(number, int) or number < low:
            raise ConfigurationError(f"{_SETTING}: {key} must be an integer >= {low}, got {options[key]!r}")
    if options.get("event_encoding", "map") not in ("map", "array"):
        raise ConfigurationError(
            f"{_SETTING}: event_encoding must be \"map\" (vLLM >= 0.24) or \"array\" (vLLM <= 0.23), "
            f"got {options['event_encoding']!r}"
        )
    if not options.get("endpoint", "tcp://*:5557"):
        raise ConfigurationError(f"{_SETTING}: endpoint must not be empty")
    return KVEventsConfig(**options)


# -- block hashes ---------------------------------------------------------------------------------------------
def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class VllmBlockHasher:
    """vLLM's default prefix-cache block hash (``prefix_caching_hash_algo="sha256"``, vLLM >= 0.10).

    ``hash(block) = sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), HIGHEST_PROTOCOL))`` where
    ``parent`` is the previous block's 32-byte digest, or ``none_hash`` for a sequence's first block, and
    ``extra_keys`` is None (no LoRA, multimodal input or cache salt). ``none_hash`` is
    ``sha256(pickle.dumps(seed))`` with ``seed`` = ``PYTHONHASHSEED`` (read at construction when not given),
    or 32 random bytes when that is unset, as vLLM does: set ``PYTHONHASHSEED`` for hashes that agree across
    restarts and replicas.
    """

    def __init__(self, seed: str | None = None) -> None:
        seed = os.environ.get("PYTHONHASHSEED") if seed is None else seed
        self.none_hash: bytes = os.urandom(32) if seed is None else _sha256_pickle(seed)

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None
    ) -> bytes:
        """The 32-byte digest of one full block following ``parent`` (None: the sequence's first block)."""
        tokens = tuple(int(token) for token in token_ids)
        return _sha256_pickle((self.none_hash if parent is None else parent, tokens, extra_keys))

    def hash_prompt(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        """Digests of the full blocks of ``token_ids`` in order (a trailing partial block has none)."""
        digests: list[bytes] = []
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            digests.append(self.hash_block(digests[-1] if digests else None, token_ids[start : start + block_size]))
        return digests


def external_block_hash(digest: bytes) -> int:
    """The int an event carries for ``digest``: its low 64 bits, unsigned (vLLM's ``maybe_convert_block_hash``
    with its default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)."""
    return int.from_bytes(digest, "big") & 0xFFFF_FFFF_FFFF_FFFF


# -- events and their encoding ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks ``block_hashes`` (a chain, parent first) became cached; ``token_ids`` are all their tokens in
    order, ``block_size`` per block; ``parent_block_hash`` is the block the first one extends (None: none)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int

    def wire(self, encoding: EventEncoding) -> Any:
        """The msgpack-ready form of vLLM's ``BlockStored`` for a plain request: no LoRA (``lora_id`` and
        ``lora_name`` nil), one nil extra key per block, the device pool, KV-cache group 0 (full attention)."""
        extra_keys = [None] * len(self.block_hashes)
        fields: dict[str, Any] = {
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": MEDIUM_GPU,
            "lora_name": None,
            "extra_keys": extra_keys,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        if encoding == "map":
            return {"type": "BlockStored", **fields}
        return ["BlockStored", *fields.values(), None]  # + kv_cache_spec_sliding_window: arrays keep every field


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks ``block_hashes`` are no longer cached."""

    block_hashes: list[int]

    def wire(self, encoding: EventEncoding) -> Any:
        """The msgpack-ready form of vLLM's ``BlockRemoved`` (device pool, KV-cache group 0)."""
        if encoding == "map":
            return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": MEDIUM_GPU, "group_idx": 0}
        return ["BlockRemoved", self.block_hashes, MEDIUM_GPU, 0]


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Nothing is cached any more."""

    def wire(self, encoding: EventEncoding) -> Any:
        return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def encode_event_batch(
    ts: float, events: Sequence[KVCacheEvent], encoding: EventEncoding = "map", data_parallel_rank: int = 0
) -> bytes:
    """vLLM's ``KVEventBatch`` as msgpack: the positional array ``[ts, events, data_parallel_rank]`` (vLLM's
    publisher always stamps its rank; a single engine is rank 0), each event as :meth:`BlockStored.wire`."""
    import msgpack

    return msgpack.packb([float(ts), [event.wire(encoding) for event in events], data_parallel_rank])


# -- the publisher ----------------------------------------------------------------------------------------------
@runtime_checkable
class KVEventSource(Protocol):
    """A prefix cache that reports its full blocks (the core ``CacheManager``, custom_torch's ``PrefixCache``)."""

    block_size: int

    def set_event_observer(self, observer: RadixObserver | None) -> None: ...


_POLL_S = 0.02
_MAX_CHANGES_PER_BATCH = 4096
_DROP_LOG_INTERVAL_S = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class _Stored:
    parent: int | None
    blocks: Sequence[StoredBlock]


@dataclasses.dataclass(frozen=True, slots=True)
class _Removed:
    node_ids: Sequence[int]


class _Cleared:
    __slots__ = ()


_Change = Union[_Stored, _Removed, _Cleared, threading.Event]


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-rank endpoint: rank 0 keeps ``endpoint``; rank r adds r to a tcp port (a ``*`` port stays) and
    appends ``_dp{r}`` to an inproc name. Raises ConfigurationError for other transports with r > 0."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    host, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        if int(port) + data_parallel_rank > 65535:
            raise ConfigurationError(
                f"{_SETTING}: data-parallel rank {data_parallel_rank} would publish on port "
                f"{int(port) + data_parallel_rank} ({endpoint!r} plus its rank), past 65535; use a lower port")
        return f"{host}:{int(port) + data_parallel_rank}"
    if endpoint.startswith("tcp://") and port == "*":
        return endpoint
    raise ConfigurationError(
        f"{_SETTING}: cannot give data-parallel rank {data_parallel_rank} its own endpoint from {endpoint!r}; "
        "use tcp://HOST:PORT (rank r publishes on PORT + r) or inproc://NAME"
    )


def check_rank_endpoints(config: KVEventsConfig | None, size: int) -> None:
    """ConfigurationError unless ``size`` data-parallel ranks can each open their own sockets of ``config`` (as
    :func:`offset_endpoint` gives them): every rank's transport must take an offset (within the port range), no
    two ranks' endpoints may be the same, and no two sockets that bind (the replay socket; the publisher on a
    wildcard host) may bind one TCP port where their hosts overlap (``*`` / ``0.0.0.0`` / ``::`` overlap every
    host)."""
    if config is None or not config.publishes:
        return
    seen: dict[str, str] = {}
    bound: list[tuple[tuple[str, int], str]] = []  # (host, port) bound so far, and whose
    for rank in range(size):
        for name, base in (("endpoint", config.endpoint), ("replay_endpoint", config.replay_endpoint)):
            endpoint = offset_endpoint(base, rank)
            if endpoint is None or endpoint.endswith(":*"):
                continue
            where = f"rank {rank}'s {name} ({endpoint})"
            clash = seen.get(endpoint)
            address = _tcp_address(endpoint) if name == "replay_endpoint" or _binds(endpoint) else None
            if clash is None and address is not None:
                clash = next((other for taken, other in bound if _overlap(taken, address)), None)
            if clash is not None:
                raise ConfigurationError(
                    f"{_SETTING}: with {size} data-parallel replicas, {where} binds the address of {clash} (each "
                    f"rank adds its rank to the ports); space the endpoint and replay_endpoint ports at least {size} "
                    "apart")
            seen[endpoint] = where
            if address is not None:
                bound.append((address, where))


_WILDCARD = "*"
_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def _overlap(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether binding TCP ``(host, port)`` addresses ``a`` and ``b`` clash: one port, and one host or a wildcard."""
    return a[1] == b[1] and (a[0] == b[0] or _WILDCARD in (a[0], b[0]))


def _tcp_address(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://HOST:PORT`` endpoint, every wildcard host as ``*``; None for other forms."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdigit():
        return None
    return (_WILDCARD if host in _WILDCARD_HOSTS else host.strip("[]").lower(), int(port))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a stable address (wildcard host, ipc, inproc); connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes one cache's changes as vLLM KV-event batches on a ZMQ PUB socket (see docs/kv-events.md).

    As a :class:`RadixObserver` it only queues (``put_nowait``, never blocking the engine; beyond
    ``max_queue_size`` a change is dropped and counted in ``dropped_changes``; a chain stored under a dropped
    block cannot be hashed and is dropped too, counted in ``orphaned_changes``). Its thread hashes the blocks
    (:class:`VllmBlockHasher`), sends everything queued since the last send as ONE batch
    ``[topic, seq (8 bytes, big-endian), payload]`` with ``seq`` = 0, 1, 2..., keeps the last ``buffer_steps``
    batches (stamped with ``data_parallel_rank``, whose endpoints are vLLM's per-rank ones: :func:`offset_endpoint`),
    and answers replay requests ``[identity, b"", start_seq]`` on ``replay_endpoint`` with
    ``[identity, b"", topic, seq, payload]`` for each buffered batch from ``start_seq`` on, then
    ``[identity, b"", b"", END_SEQ, b""]`` (vLLM 0.26's replay, which added the topic frame). Raises
    ConfigurationError if pyzmq or msgpack is missing or an endpoint
    cannot be bound / connected. ``close`` publishes what is queued, then releases the sockets.
    """

    def __init__(
        self, config: KVEventsConfig, *, hasher: VllmBlockHasher | None = None, data_parallel_rank: int = 0
    ) -> None:
        try:
            import msgpack  # noqa: F401  (encode_event_batch needs it on the publisher thread)
            import zmq
        except ImportError as exc:
            raise ConfigurationError(
                f"{_SETTING} needs pyzmq and msgpack ({exc}); install them: pip install 'gemmaserve[kv-events]'"
            ) from None
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        endpoint = offset_endpoint(config.endpoint, data_parallel_rank) or config.endpoint
        replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self.hasher = hasher or VllmBlockHasher()
        self.block_size = 0
        self.batches_sent = 0
        self.events_sent = 0
        self.dropped_changes = 0  # written by the engine's thread only
        self.orphaned_changes = 0  # written by the publisher thread only
        self._source: KVEventSource | None = None
        self._changes: queue.Queue[_Change] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._digests: dict[int, bytes] = {}  # node id -> digest of every block announced and not removed
        self._next_seq = 0
        self._cleared_last = False  # the last change queued was a clear (the engine's thread, then close())
        self._last_drop_log = 0.0
        self._topic = config.topic.encode()
        self._stopping = threading.Event()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: Any = None
        try:
            self._pub.setsockopt(zmq.LINGER, 500)
            self._pub.set_hwm(config.hwm)
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigurationError(
                f"{_SETTING}: cannot open the KV event sockets (endpoint {endpoint!r}, replay_endpoint "
                f"{replay_endpoint!r}): {exc}"
            ) from None
        self._thread = threading.Thread(target=self._run, name="gemmaserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (%s; replay %s, topic %r, %s encoding)", self.endpoint,
                    "bound" if _binds(config.endpoint) else "connected to", self.replay_endpoint or "off",
                    config.topic, config.event_encoding)

    # -- wiring ---------------------------------------------------------------------------------------------------
    def attach(self, source: KVEventSource) -> None:
        """Publish ``source``'s changes (one source per publisher). The first batch begins with AllBlocksCleared
        (a subscriber that followed an earlier process on these endpoints, one killed before it could say so,
        forgets that process's blocks), then announces the blocks ``source`` caches already."""
        if self._source is not None:
            raise RuntimeError("ZmqEventPublisher: already attached to a cache")
        self._source = source
        self.block_size = source.block_size
        self._put(_Cleared())
        source.set_event_observer(self)

    # -- RadixObserver: the engine's thread, under the cache's serialization -----------------------------------
    def blocks_stored(self, parent: int | None, blocks: Sequence[StoredBlock]) -> None:
        self._put(_Stored(parent, blocks))

    def blocks_removed(self, node_ids: Sequence[int]) -> None:
        self._put(_Removed(node_ids))

    def all_cleared(self) -> None:
        self._put(_Cleared())

    def _put(self, change: _Change) -> None:
        try:
            self._changes.put_nowait(change)
            self._cleared_last = isinstance(change, _Cleared)
        except queue.Full:
            self.dropped_changes += 1
            now = time.monotonic()
            if now - self._last_drop_log >= _DROP_LOG_INTERVAL_S:
                self._last_drop_log = now
                logger.warning(
                    "KV events: the publisher queue is full (max_queue_size=%d); %d cache changes dropped so far, "
                    "so subscribers' view of the cache drifts", self.config.max_queue_size, self.dropped_changes)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every change queued before this call has been published; False on timeout."""
        if not self._thread.is_alive():
            return self._changes.empty()
        marker = threading.Event()
        try:
            self._changes.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.wait(timeout)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` stopped the publisher thread."""
        return self._stopping.is_set() and not self._thread.is_alive()

    def close(self, timeout: float = 2.0) -> None:
        """Detach from the cache, publish what is queued and a last AllBlocksCleared (the engine's blocks go with
        it; none is added when the cache's own last change was a clear) within ``timeout`` seconds, stop the thread
        and close the sockets. Idempotent."""
        if self._source is not None:
            self._source.set_event_observer(None)
            self._source = None
            if not self._cleared_last:
                self._put(_Cleared())
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %.1f s", timeout)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close()
        if not self._context.closed:
            self._context.term()

    # -- the publisher thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                first = self._changes.get(timeout=_POLL_S)
            except queue.Empty:
                first = None
            changes: list[_Change] = [] if first is None else [first]
            while len(changes) < _MAX_CHANGES_PER_BATCH:
                try:
                    changes.append(self._changes.get_nowait())
                except queue.Empty:
                    break
            try:
                self._publish(changes)
                self._serve_replays()
            except Exception:  # never let one bad batch stop publishing
                logger.exception("KV events: publishing failed")
            # stop once asked and nothing is left: close() queues its last clear just before it asks, so a poll that
            # timed out just before that put must not end the thread with the clear unsent
            if first is None and self._stopping.is_set() and self._changes.empty():
                return

    def _publish(self, changes: list[_Change]) -> None:
        events: list[KVCacheEvent] = []
        markers: list[threading.Event] = []
        for change in changes:
            if isinstance(change, threading.Event):
                markers.append(change)
                continue
            event = self._translate(change)
            if event is not None:
                events.append(event)
        if events:
            payload = encode_event_batch(time.time(), events, self.config.event_encoding, self.data_parallel_rank)
            seq = self._next_seq
            self._next_seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.batches_sent += 1
            self.events_sent += len(events)
        for marker in markers:  # set after the send: flush() returns once the batch is out
            marker.set()

    def _translate(self, change: _Change) -> KVCacheEvent | None:
        """The vLLM event for one index change, keeping ``_digests`` in step. A chain whose parent is unknown
        (dropped from a full queue) cannot be hashed: it is dropped too, and counted."""
        if isinstance(change, _Stored):
            parent = None
            if change.parent is not None:
                parent = self._digests.get(change.parent)
                if parent is None:
                    self.orphaned_changes += 1
                    return None
            hashes: list[int] = []
            tokens: list[int] = []
            previous = parent
            for block in change.blocks:
                digest = self.hasher.hash_block(previous, block.token_ids)
                self._digests[block.node_id] = digest
                hashes.append(external_block_hash(digest))
                tokens.extend(block.token_ids)
                previous = digest
            return BlockStored(hashes, None if parent is None else external_block_hash(parent), tokens,
                               self.block_size)
        if isinstance(change, _Removed):
            removed = [self._digests.pop(node_id, None) for node_id in change.node_ids]
            known = [external_block_hash(digest) for digest in removed if digest is not None]
            return BlockRemoved(known) if known else None
        self._digests.clear()
        return AllBlocksCleared()

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        import zmq

        while self._replay.poll(0):
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("KV events: ignoring a malformed replay request of %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):  # the PUB frames, topic included (vLLM >= 0.26's replay)
                if seq >= start_seq:
                    self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))
