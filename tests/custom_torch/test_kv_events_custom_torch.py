"""KV-cache events from custom_torch's own prefix cache: a ZMQ subscriber's view (BlockStored minus BlockRemoved)
equals the vLLM hashes of the blocks the cache's radix index holds, through shared prefixes, eviction and a
clear (the legacy array encoding on the wire, which the subscriber reads as well)."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from fixtures_backend import one_torch_thread  # noqa: E402, F401  (autouse)
from kv_event_subscriber import EventSubscriber, spec_block_hashes  # noqa: E402

from gemmaserve.engine import build_engine  # noqa: E402
from gemmaserve.sampling_params import SamplingParams  # noqa: E402
from gemmaserve.settings import CoreSettings  # noqa: E402

BASE = [(13 * i + 7) % 500 + 4 for i in range(24)]  # six blocks of 4 every prompt shares


def test_a_subscriber_follows_custom_torchs_prefix_cache(tiny_gemma4_dir, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "5")
    monkeypatch.setenv("CUSTOM_BACKEND_KV_BLOCKS", "16")  # small pools: the later prompts evict earlier blocks
    settings = CoreSettings(
        backend="custom-cpu", device="cpu", dtype="float32", model=str(tiny_gemma4_dir), kv_block_size=4,
        max_batch_size=2, prefill_chunk_tokens=16, max_active_kv_tokens=4096,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                          "replay_endpoint": "tcp://127.0.0.1:*", "event_encoding": "array"},
    )
    engine = build_engine(settings)
    publisher = engine.kv_events
    assert publisher is not None
    cache = engine.backend.prefix_cache  # type: ignore[attr-defined]
    subscriber = EventSubscriber(publisher.endpoint, publisher.replay_endpoint or "")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    try:
        with engine:
            subscriber.wait_joined(lambda k: engine.generate([[5, 6, 7, 8 + k, 9]], SamplingParams(max_tokens=1)))
            for i in range(10):
                engine.generate([BASE + [300 + i] * 9, BASE[:12] + [400 + i] * 6], params)
            engine.stats()  # the tick in progress is over: the cache stays as it is from here on
            assert publisher.flush()
            last = publisher.batches_sent - 1
            subscriber.receive_until(last)
            blocks = subscriber.block_set(last)
            with engine.backend.lock:
                paths = cache.block_paths()
                evicted = cache.stats["evicted_blocks"]
            assert blocks.hashes == spec_block_hashes(paths, "5") and paths
            assert evicted >= 1 and blocks.counts["BlockRemoved"] >= 1
            with engine.backend.lock:
                cache.clear()  # no live row: everything goes, reported as one AllBlocksCleared
                assert cache.block_paths() == []
            assert publisher.flush()
            subscriber.receive_until(last + 1)
            cleared = subscriber.block_set(last + 1)
            assert cleared.hashes == set() and cleared.counts["AllBlocksCleared"] == 2  # batch 0's, and this one
    finally:
        engine.shutdown()
        subscriber.close()
