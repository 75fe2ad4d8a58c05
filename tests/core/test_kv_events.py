"""KV-cache events in vLLM's format: the hash definition, the msgpack layout of each event, the config parser,
the publisher (queue, batches, replay) and an engine whose prefix cache a real ZMQ subscriber follows."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest

msgpack = pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")

from kv_event_subscriber import END_SEQ, BlockSet, EventSubscriber, event_type, replay, spec_block_hashes  # noqa: E402

from gemmaserve.backend import BackendCapabilities  # noqa: E402
from gemmaserve.engine import build_engine  # noqa: E402
from gemmaserve.errors import ConfigurationError  # noqa: E402
from gemmaserve.hardware import DeviceReport  # noqa: E402
from gemmaserve.hookspecs import hookimpl  # noqa: E402
from gemmaserve.kv import CacheManager, RadixPrefixIndex  # noqa: E402
from gemmaserve.kv.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    VllmBlockHasher,
    ZmqEventPublisher,
    encode_event_batch,
    external_block_hash,
    offset_endpoint,
    parse_kv_events_config,
)
from gemmaserve.plugins import register_plugin, unregister_plugin  # noqa: E402
from gemmaserve.registry import BackendSpec  # noqa: E402
from gemmaserve.sampling_params import SamplingParams  # noqa: E402
from gemmaserve.settings import CoreSettings, load_settings  # noqa: E402
from gemmaserve.testing.kv_machines import EventLog, expected_block_hashes  # noqa: E402
from gemmaserve.testing.reference_backend import ReferenceBackend  # noqa: E402

LOOPBACK = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}


def sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# -- the hash definition ---------------------------------------------------------------------------------------
def test_block_hash_is_vllms_sha256_of_the_pickled_parent_tokens_and_extra_keys(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    hasher = VllmBlockHasher()
    none_hash = sha256_pickle("1234")  # vLLM: NONE_HASH = sha256(PYTHONHASHSEED) when it is set
    assert hasher.none_hash == none_hash
    first = sha256_pickle((none_hash, (5, 6, 7, 8), None))
    second = sha256_pickle((first, (9, 10, 11, 12), None))
    assert hasher.hash_block(None, [5, 6, 7, 8]) == first
    assert hasher.hash_block(first, (9, 10, 11, 12)) == second
    assert hasher.hash_prompt([5, 6, 7, 8, 9, 10, 11, 12, 13], 4) == [first, second]  # the partial block: none
    assert external_block_hash(second) == int.from_bytes(second, "big") & (2**64 - 1)
    assert external_block_hash(b"\xff" * 24 + b"\x80" + b"\x00" * 7) == 2**63  # the LOW 64 bits, unsigned
    assert VllmBlockHasher(seed="other").none_hash == sha256_pickle("other")


def test_without_pythonhashseed_the_none_hash_is_random_as_in_vllm(monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a, b = VllmBlockHasher(), VllmBlockHasher()
    assert len(a.none_hash) == 32 and a.none_hash != b.none_hash


# -- the wire format -------------------------------------------------------------------------------------------
def _events() -> list[Any]:
    return [BlockStored([11, 2**64 - 1], None, [1, 2, 3, 4], 2), BlockStored([12], 11, [5, 6], 2),
            BlockRemoved([12, 11]), AllBlocksCleared()]


def test_map_encoding_is_vllm_024_to_028_tagged_maps_in_a_positional_batch() -> None:
    ts, events, rank = msgpack.unpackb(encode_event_batch(1700000000.5, _events(), "map"))
    assert (ts, rank) == (1700000000.5, 0)
    common = {"lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
              "kv_cache_spec_kind": "full_attention"}
    assert events[0] == {"type": "BlockStored", "block_hashes": [11, 2**64 - 1], "parent_block_hash": None,
                         "token_ids": [1, 2, 3, 4], "block_size": 2, **common, "extra_keys": [None, None]}
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    assert events[1]["parent_block_hash"] == 11 and events[1]["token_ids"] == [5, 6]
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [12, 11], "medium": "GPU", "group_idx": 0}
    assert events[3] == {"type": "AllBlocksCleared"}


def test_array_encoding_is_vllms_legacy_positional_layout() -> None:
    ts, events, rank = msgpack.unpackb(encode_event_batch(2.0, _events(), "array"))
    assert (ts, rank) == (2.0, 0)
    assert events[0] == ["BlockStored", [11, 2**64 - 1], None, [1, 2, 3, 4], 2, None, "GPU", None, [None, None], 0,
                         "full_attention", None]
    assert events[2] == ["BlockRemoved", [12, 11], "GPU", 0]
    assert events[3] == ["AllBlocksCleared"]


def _vllm_structs(array_like: bool, *, legacy_fields: bool = False) -> Any:
    """vLLM's event structs (vllm/distributed/kv_events.py): v0.28 (tagged maps), or array_like as before; with
    ``legacy_fields`` the six-field BlockStored of vLLM 0.10's subscriber example. Built with ``defstruct``:
    this module's annotations are strings, which msgspec could not resolve to local classes."""
    msgspec = pytest.importorskip("msgspec")
    from typing import Optional, Union

    options = {"array_like": array_like, "omit_defaults": True, "gc": False, "tag": True}
    stored_fields: list[Any] = [("block_hashes", list[int]), ("parent_block_hash", Optional[int]),
                                ("token_ids", list[int]), ("block_size", int), ("lora_id", Optional[int]),
                                ("medium", Optional[str])]
    if not legacy_fields:
        stored_fields += [("lora_name", Optional[str]), ("extra_keys", Optional[list[Optional[tuple]]], None),
                          ("group_idx", Optional[int], None), ("kv_cache_spec_kind", Optional[str], None),
                          ("kv_cache_spec_sliding_window", Optional[int], None), ("locality", Optional[str], None)]
    stored = msgspec.defstruct("BlockStored", stored_fields, **options)
    removed = msgspec.defstruct("BlockRemoved", [("block_hashes", list[int]), ("medium", Optional[str]),
                                                 ("group_idx", Optional[int], None)], **options)
    cleared = msgspec.defstruct("AllBlocksCleared", [], **options)
    batch = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[Union[stored, removed, cleared]]), ("data_parallel_rank", Optional[int], None)],
        array_like=True, omit_defaults=True, gc=False,
    )
    return msgspec, batch


@pytest.mark.parametrize("encoding,array_like,legacy", [("map", False, False), ("array", True, False),
                                                        ("array", True, True)])
def test_vllms_own_decoder_structs_read_the_payload(encoding: str, array_like: bool, legacy: bool) -> None:
    msgspec, batch_type = _vllm_structs(array_like, legacy_fields=legacy)
    batch = msgspec.msgpack.decode(encode_event_batch(3.0, _events(), encoding), type=batch_type)
    stored, child, removed, cleared = batch.events
    assert (batch.ts, batch.data_parallel_rank) == (3.0, 0)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == (
        [11, 2**64 - 1], None, [1, 2, 3, 4], 2)
    assert stored.medium == "GPU" and child.parent_block_hash == 11
    assert removed.block_hashes == [12, 11] and type(cleared).__name__ == "AllBlocksCleared"
    if not legacy:
        assert stored.group_idx == 0 and stored.kv_cache_spec_kind == "full_attention" and stored.lora_name is None


# -- the config ------------------------------------------------------------------------------------------------
def test_config_defaults_are_vllms() -> None:
    config = parse_kv_events_config("{}")
    assert config == KVEventsConfig()
    assert (config.enable_kv_cache_events, config.endpoint, config.replay_endpoint, config.buffer_steps,
            config.hwm, config.max_queue_size, config.topic) == (False, "tcp://*:5557", None, 10_000, 100_000,
                                                                 100_000, "")
    assert config.resolved_publisher == "null" and not config.publishes
    enabled = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert enabled is not None and enabled.resolved_publisher == "zmq" and enabled.publishes
    null = parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"})
    assert null is not None and not null.publishes
    assert parse_kv_events_config(None) is None and parse_kv_events_config("  ") is None
    assert parse_kv_events_config(enabled) is enabled


def test_config_accepts_a_vllm_style_dataclass() -> None:
    @dataclasses.dataclass
    class VllmKVEventsConfig:  # the shape of vllm.config.KVEventsConfig
        enable_kv_cache_events: bool = True
        publisher: str = "zmq"
        endpoint: str = "tcp://*:6000"
        replay_endpoint: str | None = None
        buffer_steps: int = 10
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = "kv"

    config = parse_kv_events_config(VllmKVEventsConfig())
    assert config is not None and (config.endpoint, config.buffer_steps, config.topic) == ("tcp://*:6000", 10, "kv")


@pytest.mark.parametrize("value,message", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key 'endpont'; accepted keys: "
     "enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic"),
    ('{"enable_kv_cache_events": true,}', "is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"publisher": "kafka"}', 'publisher must be "zmq" or "null"'),
    ('{"buffer_steps": -1}', "buffer_steps must be an integer >= 0"),
    ('{"max_queue_size": 0}', "max_queue_size must be an integer >= 1"),
    ('{"hwm": 1.5}', "hwm must be an integer"),
    ('{"endpoint": 5557}', "endpoint must be a string"),
    ('{"event_encoding": "json"}', 'event_encoding must be "map"'),
])
def test_config_errors_name_the_problem(value: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match="KV_EVENTS_CONFIG") as info:
        parse_kv_events_config(value)
    assert message in str(info.value)


def test_the_setting_reads_the_env_and_refuses_bad_json(monkeypatch) -> None:
    monkeypatch.setenv("KV_EVENTS_CONFIG", '{"enable_kv_cache_events": true, "topic": "kv"}')
    config = load_settings().kv_events_config
    assert config is not None and config.topic == "kv" and config.enable_kv_cache_events
    flag = load_settings(kv_events_config='{"topic": "flag"}').kv_events_config
    assert flag is not None and flag.topic == "flag"
    monkeypatch.setenv("KV_EVENTS_CONFIG", "{not json")
    with pytest.raises(ConfigurationError, match="KV_EVENTS_CONFIG=.*is not valid JSON"):
        load_settings()
    monkeypatch.delenv("KV_EVENTS_CONFIG")
    assert load_settings().kv_events_config is None
    assert CoreSettings(kv_events_config={"enable_kv_cache_events": True}).model_dump()["kv_events_config"][
        "enable_kv_cache_events"] is True


def test_importing_gemmaserve_imports_no_zmq() -> None:
    import subprocess
    import sys

    code = "import sys, gemmaserve, gemmaserve.kv.events, gemmaserve.settings; print('zmq' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


# -- the publisher over a bare cache ---------------------------------------------------------------------------
@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    config = parse_kv_events_config({**LOOPBACK, "topic": "kv"})
    assert config is not None
    publisher = ZmqEventPublisher(config, hasher=VllmBlockHasher(seed="7"))
    yield publisher
    publisher.close()


def _store(cm: CacheManager, tokens: list[int]) -> None:
    cm.commit_store(cm.begin_store(tokens))


def test_publisher_batches_follow_the_cache_and_replay_serves_them(publisher: ZmqEventPublisher) -> None:
    cm = CacheManager(num_blocks=6, block_size=2)
    _store(cm, [1, 2, 3, 4])  # before attach: announced on attach
    publisher.attach(cm)
    subscriber = EventSubscriber(publisher.endpoint, publisher.replay_endpoint or "", topic="kv")
    try:
        subscriber.wait_joined(lambda k: _store(cm, [20 + k, 20 + k]))
        _store(cm, [1, 2, 3, 4, 5, 6, 7])  # one new full block (+ a tail, never announced)
        _store(cm, [1, 2, 9, 9])
        assert publisher.flush()
        _store(cm, [8, 8, 8, 8, 8, 8])  # 6 blocks in the pool: evicts LRU leaves
        assert publisher.flush()
        last = publisher.batches_sent - 1
        subscriber.receive_until(last)
        blocks = subscriber.block_set(last)
        assert blocks.hashes == spec_block_hashes(cm.block_paths(), "7")
        assert blocks.counts["BlockRemoved"] >= 1
        cm.clear()
        assert publisher.flush() and len(cm.block_paths()) == 0
        subscriber.receive_until(last + 1)
        ts, events, _ = msgpack.unpackb(subscriber.live[last + 1])
        assert [event_type(e) for e in events] == ["AllBlocksCleared"]
        assert [seq for seq, _ in replay(subscriber.context, publisher.replay_endpoint or "", last)] == [last, last + 1]
        assert replay(subscriber.context, publisher.replay_endpoint or "", last + 2) == []  # just the end marker
    finally:
        subscriber.close()


def test_a_replay_request_gets_every_buffered_batch_and_the_end_marker(publisher: ZmqEventPublisher) -> None:
    index = RadixPrefixIndex(2)
    index_source = _IndexSource(index)
    publisher.attach(index_source)
    for n in range(4):
        index.insert([n, n, n, n], [f"{n}a", f"{n}b"])
        assert publisher.flush()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        frames = []
        for _ in range(3):
            assert dealer.poll(5000), "the replay socket did not answer"
            frames.append(dealer.recv_multipart())
        # vLLM 0.26's replay: [b"", topic, seq, payload] per batch, then [b"", b"", END_SEQ, b""]
        assert [f[2] for f in frames] == [(2).to_bytes(8, "big"), (3).to_bytes(8, "big"), END_SEQ]
        assert [f[1] for f in frames[:2]] == [b"kv"] * 2  # the fixture's topic
        assert frames[-1] == [b"", b"", END_SEQ, b""]
        ts, events, rank = msgpack.unpackb(frames[0][3])
        assert events[0]["token_ids"] == [2, 2, 2, 2] and events[0]["parent_block_hash"] is None
        dealer.send_multipart([b"", b"short"])  # malformed: ignored, the socket keeps serving
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        assert dealer.poll(5000)
        assert dealer.recv_multipart()[2] == (3).to_bytes(8, "big")
    finally:
        dealer.close()
        context.term()


class _IndexSource:
    """A bare radix index as a KVEventSource."""

    def __init__(self, index: RadixPrefixIndex) -> None:
        self.index = index
        self.block_size = index.block_size

    def set_event_observer(self, observer: Any) -> None:
        self.index.set_observer(observer)


def test_a_full_queue_drops_and_counts_instead_of_blocking_the_engine(monkeypatch) -> None:
    config = parse_kv_events_config({**LOOPBACK, "max_queue_size": 2})
    assert config is not None
    publisher = ZmqEventPublisher(config, hasher=VllmBlockHasher(seed="7"))
    entered, release = threading.Event(), threading.Event()
    real = publisher._publish

    def stalled(changes: list[Any]) -> None:
        if changes:
            entered.set()
            release.wait(10)
        real(changes)

    index = RadixPrefixIndex(1)
    publisher.attach(_IndexSource(index))
    assert publisher.flush() and publisher.events_sent == 1  # the attach's AllBlocksCleared
    monkeypatch.setattr(publisher, "_publish", stalled)
    try:
        index.insert([1], ["a"])
        assert entered.wait(10)  # the thread holds that change: the queue is empty again
        index.insert([1, 2], ["a", "b"])
        index.insert([3], ["c"])  # the queue (2) is full now
        index.insert([1, 2, 4], ["a", "b", "d"])  # dropped at once, not blocking
        index.insert([5], ["e"])  # dropped
        assert publisher.dropped_changes == 2
        release.set()
        assert publisher.flush()
        assert publisher.events_sent == 1 + 3 and publisher.orphaned_changes == 0
    finally:
        release.set()
        publisher.close()


def test_a_chain_under_a_dropped_block_is_dropped_and_counted() -> None:
    config = parse_kv_events_config(LOOPBACK)
    assert config is not None
    publisher = ZmqEventPublisher(config)
    try:
        from gemmaserve.kv.radix import StoredBlock

        publisher.blocks_stored(41, [StoredBlock(42, (1, 2))])  # its parent was never announced
        publisher.blocks_removed([42, 43])
        assert publisher.flush()
        assert publisher.orphaned_changes == 1 and publisher.batches_sent == 0
    finally:
        publisher.close()


def test_data_parallel_ranks_get_vllms_per_rank_endpoints() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint("inproc://kv", 3) == "inproc://kv_dp3"
    assert offset_endpoint(None, 3) is None
    with pytest.raises(ConfigurationError, match="data-parallel rank 1"):
        offset_endpoint("ipc:///tmp/kv", 1)
    config = parse_kv_events_config({**LOOPBACK, "endpoint": "inproc://kv-rank"})
    assert config is not None
    publisher = ZmqEventPublisher(config, data_parallel_rank=1)
    try:
        assert publisher.endpoint == "inproc://kv-rank_dp1"
        index = RadixPrefixIndex(1)
        publisher.attach(_IndexSource(index))
        index.insert([1], ["a"])
        assert publisher.flush()
        (seq, payload), = replay(zmq.Context.instance(), publisher.replay_endpoint or "", 0)
        assert msgpack.unpackb(payload)[2] == 1  # the batch names its rank
    finally:
        publisher.close()


def test_a_busy_endpoint_is_a_configuration_error() -> None:
    config = parse_kv_events_config(LOOPBACK)
    assert config is not None
    first = ZmqEventPublisher(config)
    try:
        taken = dataclasses.replace(config, endpoint=first.endpoint.replace("127.0.0.1", "*"))
        with pytest.raises(ConfigurationError, match="cannot open the KV event sockets"):
            ZmqEventPublisher(taken)
    finally:
        first.close()


# -- an engine whose prefix cache a subscriber follows ---------------------------------------------------------
class _ReferencePlugin:
    @hookimpl
    def gemmaserve_register_backends(self, register) -> None:  # type: ignore[no-untyped-def]
        register(BackendSpec("reference-kv", "gemmaserve.testing.reference_backend:create_reference_backend",
                             ("cpu",), description="deterministic toy backend"))
        register(BackendSpec("reference-no-cache", f"{__name__}:_backend_without_a_prefix_cache", ("cpu",),
                             description="caches nothing"))


def _backend_without_a_prefix_cache(model_path: str, device: str, settings: CoreSettings) -> ReferenceBackend:
    backend = ReferenceBackend()
    backend.capabilities = dataclasses.replace(backend.capabilities, uses_core_cache_manager=False)
    return backend


@pytest.fixture
def reference_backends(monkeypatch) -> Iterator[None]:
    monkeypatch.setattr("gemmaserve.selection.detect_devices", lambda: DeviceReport("cpu", ("cpu",)))
    register_plugin(_ReferencePlugin(), "kv-events-test-plugin")
    yield
    unregister_plugin("kv-events-test-plugin")


def _settings(**overrides: Any) -> CoreSettings:
    values = {"backend": "reference-kv", "device": "cpu", "model": "/no/weights", "kv_block_size": 4,
              "prefix_cache_blocks": 14, "max_batch_size": 4, "prefill_chunk_tokens": 8, **overrides}
    return CoreSettings(**values)


PREAMBLE = [(7 * i + 3) % 60 + 2 for i in range(16)]  # four full blocks every prompt shares


def test_a_subscriber_follows_the_engines_prefix_cache(reference_backends, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    engine = build_engine(_settings(prefix_cache_blocks=10, kv_events_config={**LOOPBACK, "topic": "gemma"}))
    publisher = engine.kv_events
    assert publisher is not None and engine.cache_manager is not None
    subscriber = EventSubscriber(publisher.endpoint, publisher.replay_endpoint or "", topic="gemma")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    try:
        with engine:
            engine.generate([PREAMBLE + [40 + i, 41, 42, 43, 44] for i in range(3)], params)
            engine.stats()  # waits for the tick in progress: the cache is still from here on
            assert publisher.flush()
            first = publisher.batches_sent - 1
            assert subscriber.block_set(first).hashes == spec_block_hashes(engine.cache_manager.block_paths(), "99")
            # from the replay socket alone: the subscriber joined after the batches went out live
            subscriber.wait_joined(lambda k: engine.generate([[2, 3, 4, 5 + k]], SamplingParams(max_tokens=1)))
            engine.generate([PREAMBLE + [50, 51, 52, 53, 54, 55, 56, 57]], params)  # more than fits: evicts
            engine.generate([PREAMBLE + [60, 61, 62, 63]], params)
            engine.stats()
            assert publisher.flush()
            last = publisher.batches_sent - 1
            subscriber.receive_until(last)
            blocks = subscriber.block_set(last)
            paths = engine.cache_manager.block_paths()
            assert blocks.hashes == spec_block_hashes(paths, "99") and len(paths) > 4
            assert blocks.counts["BlockStored"] >= 4 and blocks.counts["BlockRemoved"] >= 1
            assert engine.cache_manager.stats().evictions >= 1
            engine.cache_manager.clear()
            assert publisher.flush()
            subscriber.receive_until(last + 1)
            assert subscriber.block_set(last + 1).hashes == spec_block_hashes(engine.cache_manager.block_paths(), "99")
    finally:
        engine.shutdown()
        subscriber.close()
    engine.shutdown()  # idempotent: the publisher was closed once


def test_a_restarted_engine_clears_first_and_a_closing_one_clears_last(reference_backends, monkeypatch) -> None:
    """A replica killed without a word and started again on the same endpoints numbers its batches from 0 again:
    its batch 0 begins with AllBlocksCleared, so a subscriber that held the old process's blocks drops them; a
    core-cache engine that shuts down says AllBlocksCleared last (custom_torch clears its own cache then)."""
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = build_engine(_settings(kv_events_config=LOOPBACK))
    publisher = first.kv_events
    assert publisher is not None
    subscriber = EventSubscriber(publisher.endpoint, publisher.replay_endpoint or "")
    try:
        with first:
            subscriber.wait_joined(lambda k: first.generate([[2, 3, 4, 5 + k]], SamplingParams(max_tokens=1)))
            first.generate([PREAMBLE + [40, 41, 42, 43, 44]], params)
            first.stats()
            assert publisher.flush()
            held = subscriber.block_set(publisher.batches_sent - 1)  # from the replay socket
            assert held.hashes and held.counts["AllBlocksCleared"] == 1
            first_events = [event_type(e) for e in msgpack.unpackb(subscriber.stream(0)[0][1])[1]]
            assert first_events[0] == "AllBlocksCleared"
            sent = publisher.batches_sent
            subscriber.receive_until(sent - 1)
        first.shutdown()
        subscriber.receive_until(sent)
        assert [event_type(e) for e in msgpack.unpackb(subscriber.live[sent])[1]] == ["AllBlocksCleared"]
    finally:
        first.shutdown()
        subscriber.close()


def test_a_replica_that_restarts_tells_subscribers_to_forget_its_old_blocks() -> None:
    """The old process's blocks held by a router (the process died before saying anything: the router read only
    its batches up to then) are cleared by the new publisher's batch 0, before the new cache's own blocks, one of
    them the same as an old one, are announced."""
    config = parse_kv_events_config(LOOPBACK)
    assert config is not None
    old_cache, new_cache = CacheManager(num_blocks=6, block_size=2), CacheManager(num_blocks=6, block_size=2)
    _store(new_cache, [1, 2])  # cached before the new publisher attaches: announced after the clear
    router = BlockSet()
    publishers: list[ZmqEventPublisher] = []
    context = zmq.Context()
    try:
        for cache, tokens in ((old_cache, [1, 2, 3, 4]), (new_cache, [7, 8])):
            publisher = ZmqEventPublisher(config, hasher=VllmBlockHasher(seed="7"))
            publishers.append(publisher)
            publisher.attach(cache)
            _store(cache, tokens)
            assert publisher.flush()
            for _, payload in replay(context, publisher.replay_endpoint or "", 0):
                router.apply(msgpack.unpackb(payload))  # BlockSet refuses a block stored twice
            assert router.hashes == spec_block_hashes(cache.block_paths(), "7")
        assert router.counts["AllBlocksCleared"] == 2
    finally:
        for publisher in publishers:
            publisher.close()
        context.term()


def test_events_for_a_backend_without_a_prefix_cache_are_refused(reference_backends) -> None:
    with pytest.raises(ConfigurationError, match="PREFIX_CACHE_BLOCKS=0"):
        build_engine(_settings(prefix_cache_blocks=0, kv_events_config=LOOPBACK))
    with pytest.raises(ConfigurationError, match="'reference-no-cache' has no prefix cache"):
        build_engine(_settings(backend="reference-no-cache", kv_events_config=LOOPBACK))
    disabled = {**LOOPBACK, "enable_kv_cache_events": False}
    engine = build_engine(_settings(prefix_cache_blocks=0, kv_events_config=disabled))
    assert engine.kv_events is None  # events off: nothing to refuse
    engine.shutdown()
    engine = build_engine(_settings(kv_events_config={**LOOPBACK, "publisher": "null"}))
    assert engine.kv_events is None  # vLLM's null publisher: computed for nobody
    engine.shutdown()


def test_the_engine_publishes_under_its_data_parallel_rank_and_closes_the_publisher(reference_backends) -> None:
    engine = build_engine(_settings(data_parallel_rank=2, kv_events_config={**LOOPBACK, "endpoint": "inproc://dp"}))
    publisher = engine.kv_events
    assert publisher is not None and publisher.endpoint == "inproc://dp_dp2"
    try:
        with engine:
            engine.generate([PREAMBLE], SamplingParams(max_tokens=1))
            engine.stats()
            assert publisher.flush()
            batches = replay(zmq.Context.instance(), publisher.replay_endpoint or "", 0)
            assert batches and all(msgpack.unpackb(payload)[2] == 2 for _, payload in batches)
    finally:
        engine.shutdown()
    assert publisher.closed, "the engine closes its publisher at shutdown"


def test_llm_takes_kv_events_config_and_close_stops_the_publisher(reference_backends) -> None:
    from gemmaserve import LLM

    llm = LLM(model="/no/weights", backend="reference-kv", device="cpu", kv_block_size=4, prefix_cache_blocks=8,
              kv_events_config=LOOPBACK)
    publisher = llm.engine.kv_events
    assert publisher is not None
    llm.generate([PREAMBLE], SamplingParams(max_tokens=2))
    assert publisher.flush() and publisher.events_sent >= 1
    llm.close()
    assert not publisher._thread.is_alive() and publisher._pub.closed


def test_the_conformance_event_log_agrees_with_the_publisher_hashes() -> None:
    """EventLog (the state machines' replay) hashes blocks exactly as the publisher does."""
    cm = CacheManager(num_blocks=8, block_size=2)
    log = EventLog(VllmBlockHasher(seed="3"))
    cm.set_event_observer(log)
    _store(cm, [1, 2, 3, 4, 5])
    _store(cm, [1, 2, 7, 7])
    digests = expected_block_hashes(cm.block_paths(), log.hasher)
    assert log.digests() == digests
    assert {external_block_hash(d) for d in digests} == spec_block_hashes(cm.block_paths(), "3")
