"""A KV-event subscriber for tests, written from the wire protocol (docs/kv-events.md), not from the publisher.

``EventSubscriber`` reads the PUB stream and fills gaps from the replay socket, as a router does; ``replay``
asks the replay socket directly; ``BlockSet`` replays decoded events into the set of block hashes a router
holds; ``spec_block_hashes`` hashes cached block paths from the hash definition, independently of
``gemmaserve.kv.events``.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def spec_none_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH for PYTHONHASHSEED=seed: sha256 of the pickled seed string."""
    return hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def spec_block_hashes(paths: Sequence[Sequence[tuple[int, ...]]], seed: str) -> set[int]:
    """The 64-bit event hashes of cached blocks given as block-key paths, chained from NONE_HASH."""
    out: set[int] = set()
    for path in paths:
        parent = spec_none_hash(seed)
        for key in path:
            parent = hashlib.sha256(pickle.dumps((parent, tuple(key), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.add(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def event_type(event: Any) -> str:
    """The tag of a decoded event in either encoding (map: its "type"; array: its first item)."""
    return event["type"] if isinstance(event, dict) else event[0]


_POSITIONS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def as_map(event: Any) -> dict[str, Any]:
    """A decoded event as vLLM's map encoding, from either encoding (array: the tag, then the fields in order)."""
    if isinstance(event, dict):
        return event
    names = _POSITIONS[event[0]]
    assert len(event) == 1 + len(names), f"unexpected {event[0]} layout: {event}"
    return {"type": event[0], **dict(zip(names, event[1:]))}


class BlockSet:
    """The set of block hashes a router holds after the given batches (BlockStored minus BlockRemoved)."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.counts: dict[str, int] = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def apply(self, batch: list[Any]) -> None:
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0
        for event in map(as_map, events):
            kind = event["type"]
            self.counts[kind] += 1
            if kind == "BlockStored":
                parent, new = event["parent_block_hash"], event["block_hashes"]
                assert parent is None or parent in self.hashes, "stored under a block the router does not know"
                assert not self.hashes & set(new), "a block stored twice"
                assert len(event["token_ids"]) == len(new) * event["block_size"]
                self.hashes |= set(new)
            elif kind == "BlockRemoved":
                assert set(event["block_hashes"]) <= self.hashes, "removed a block never stored"
                self.hashes -= set(event["block_hashes"])
            else:
                self.hashes.clear()


def replay(context: zmq.Context, endpoint: str, start_seq: int, timeout_s: float = 5.0,
           topic: bytes | None = None) -> list[tuple[int, bytes]]:
    """Every buffered batch from ``start_seq`` on, as ``(seq, payload)``, up to the end marker. Each reply is
    vLLM's (0.26 on): ``[b"", topic, seq, payload]``, the end marker ``[b"", b"", END_SEQ, b""]``."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        got: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), "the replay socket did not answer"
            empty, got_topic, seq, payload = dealer.recv_multipart()  # four frames: the topic is one (vLLM 0.26)
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b"" and got_topic == b""
                return got
            assert topic is None or got_topic == topic, (got_topic, topic)
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()


class EventSubscriber:
    """SUB socket on ``endpoint`` (topic ``topic``) that records batches by sequence number and fills the gaps
    (the batches published before it joined) from ``replay_endpoint``."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.live: dict[int, bytes] = {}
        self.replayed: dict[int, bytes] = {}

    def wait_joined(self, poke: Callable[[int], None], timeout_s: float = 10.0) -> None:
        """Call ``poke(k)`` (which must make the publisher send a batch) until one arrives live: from then on
        every batch does (a SUB socket misses what is sent before its subscription reaches the publisher)."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while not self.live:
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            poke(attempt)
            attempt += 1
            if self.sub.poll(100):
                self._recv()

    def _recv(self) -> None:
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        self.live[int.from_bytes(seq, "big")] = payload

    def receive_until(self, last_seq: int, timeout_s: float = 10.0) -> None:
        """Read the live stream until batch ``last_seq`` arrives (AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while last_seq not in self.live:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"batch {last_seq} never arrived live (got {sorted(self.live)[-3:]})"
            if self.sub.poll(int(remaining * 1000) + 1):
                self._recv()

    def stream(self, last_seq: int) -> list[tuple[int, bytes]]:
        """Batches 0..last_seq: the live ones, the missing ones replayed (which must agree with the live)."""
        missing = [seq for seq in range(last_seq + 1) if seq not in self.live]
        if missing:
            for seq, payload in replay(self.context, self.replay_endpoint, missing[0], topic=self.topic):
                self.replayed[seq] = payload
        for seq, payload in self.replayed.items():
            assert seq not in self.live or self.live[seq] == payload, f"replayed batch {seq} differs from the live one"
        merged = {**self.replayed, **self.live}
        assert sorted(seq for seq in merged if seq <= last_seq) == list(range(last_seq + 1)), "a batch is missing"
        return [(seq, merged[seq]) for seq in range(last_seq + 1)]

    def block_set(self, last_seq: int) -> BlockSet:
        blocks = BlockSet()
        for _, payload in self.stream(last_seq):
            blocks.apply(msgpack.unpackb(payload))
        return blocks

    def close(self) -> None:
        self.sub.close()
        self.context.term()
