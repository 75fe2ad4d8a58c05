"""engine/delivery.py: engine-thread events reach each asyncio loop in order, none lost, one hand-over per scope."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaserve.engine.delivery import LoopDelivery, batched_delivery, loop_delivery
from gemmaserve.engine.request import RequestEvent


def event(request_id: str, token: int, finished: bool = False) -> RequestEvent:
    return RequestEvent(request_id, [token], finished, None)


class RecordingLoop:
    """Stands in for a loop: records each ``call_soon_threadsafe`` and runs it at once (or raises if closed)."""

    def __init__(self, closed: bool = False) -> None:
        self.calls = 0
        self.closed = closed

    def call_soon_threadsafe(self, callback, *args):  # type: ignore[no-untyped-def]
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls += 1
        callback(*args)


def collecting() -> tuple[RecordingLoop, list[int], Callable[[RequestEvent], None]]:
    """A recording loop, the tokens its sink got, and an engine callback feeding that sink."""
    loop = RecordingLoop()
    got: list[int] = []
    return loop, got, LoopDelivery(loop).callback(lambda e: got.extend(e.new_token_ids), lambda e: None)  # type: ignore[arg-type]


def test_one_hand_over_per_scope_in_order() -> None:
    loop = RecordingLoop()
    delivery = LoopDelivery(loop)  # type: ignore[arg-type]
    got: dict[str, list[int]] = {"a": [], "b": []}
    callbacks = {rid: delivery.callback(lambda e, rid=rid: got[rid].extend(e.new_token_ids), lambda e: None)
                 for rid in got}
    with batched_delivery():
        for token in range(5):
            for rid in got:
                callbacks[rid](event(rid, token))
        assert loop.calls == 0, "nothing goes over before the scope ends"
    assert loop.calls == 1
    assert got == {"a": [0, 1, 2, 3, 4], "b": [0, 1, 2, 3, 4]}


def test_outside_a_scope_each_event_goes_at_once() -> None:
    loop, got, on_event = collecting()
    on_event(event("a", 1))
    assert got == [1] and loop.calls == 1
    on_event(event("a", 2))
    assert got == [1, 2] and loop.calls == 2


def test_nested_scopes_flush_when_the_outer_one_ends() -> None:
    loop, got, on_event = collecting()
    with batched_delivery():
        with batched_delivery():
            on_event(event("a", 1))
        assert got == []
        on_event(event("a", 2))
    assert got == [1, 2] and loop.calls == 1


def test_scope_ending_by_an_exception_still_hands_over() -> None:
    loop, got, on_event = collecting()
    with pytest.raises(KeyError):
        with batched_delivery():
            on_event(event("a", 1))
            raise KeyError("tick failed")
    assert got == [1]


def test_a_closed_loop_calls_on_closed_for_every_event() -> None:
    closed: list[tuple[str, int]] = []
    delivery = LoopDelivery(RecordingLoop(closed=True))  # type: ignore[arg-type]
    puts: list[RequestEvent] = []
    a = delivery.callback(puts.append, lambda e: closed.append((e.request_id, e.new_token_ids[0])))
    b = delivery.callback(puts.append, lambda e: closed.append((e.request_id, e.new_token_ids[0])))
    with batched_delivery():
        a(event("a", 1))
        b(event("b", 2))
        a(event("a", 3))
    assert puts == [] and closed == [("a", 1), ("b", 2), ("a", 3)]


def test_a_raising_sink_does_not_hold_back_the_others() -> None:
    loop = RecordingLoop()
    delivery = LoopDelivery(loop)  # type: ignore[arg-type]
    got: list[int] = []

    def broken(e: RequestEvent) -> None:
        raise ValueError("consumer bug")

    bad = delivery.callback(broken, lambda e: None)
    good = delivery.callback(lambda e: got.extend(e.new_token_ids), lambda e: None)
    with batched_delivery():
        bad(event("a", 1))
        good(event("b", 2))
    assert got == [2]


def test_loop_delivery_is_one_per_loop() -> None:
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert loop_delivery(first) is loop_delivery(first)
        assert loop_delivery(first) is not loop_delivery(second)
    finally:
        first.close()
        second.close()


def test_a_loop_without_weak_references_still_gets_a_delivery() -> None:
    class SlotLoop:
        __slots__ = ("calls",)  # no __weakref__

        def __init__(self) -> None:
            self.calls = 0

        def call_soon_threadsafe(self, callback, *args):  # type: ignore[no-untyped-def]
            self.calls += 1
            callback(*args)

    loop = SlotLoop()
    with pytest.raises(TypeError):
        weakref.ref(loop)
    got: list[int] = []
    on_event = loop_delivery(loop).callback(lambda e: got.extend(e.new_token_ids), lambda e: None)  # type: ignore[arg-type]
    with batched_delivery():
        on_event(event("a", 1))
        on_event(event("a", 2))
    assert got == [1, 2] and loop.calls == 1


def test_the_registry_forgets_a_loop_that_is_gone() -> None:
    import gc

    from gemmaserve.engine import delivery as module

    async def use() -> weakref.ref:
        loop = asyncio.get_running_loop()
        loop_delivery(loop).callback(lambda e: None, lambda e: None)
        return weakref.ref(loop)

    ref = asyncio.run(use())
    gc.collect()
    assert ref() is None and all(loop is not None for loop in module._deliveries)


def test_a_loop_gone_before_the_hand_over_counts_as_closed() -> None:
    loop = RecordingLoop()
    closed: list[int] = []
    on_event = LoopDelivery(loop).callback(lambda e: None, lambda e: closed.extend(e.new_token_ids))  # type: ignore[arg-type]
    with batched_delivery():
        on_event(event("a", 1))
        del loop
    assert closed == [1]


def test_one_failing_loop_does_not_strand_the_others() -> None:
    class BrokenLoop(RecordingLoop):
        def call_soon_threadsafe(self, callback, *args):  # type: ignore[no-untyped-def]
            raise ValueError("not a loop")

    first = LoopDelivery(BrokenLoop()).callback(lambda e: None, lambda e: None)  # type: ignore[arg-type]
    _, got, second = collecting()
    with batched_delivery():
        first(event("a", 1))
        second(event("b", 2))
    assert got == [2]
    second(event("b", 3))  # the good loop's delivery is not stuck
    assert got == [2, 3]


@settings(max_examples=40, deadline=None)
@given(ticks=st.lists(st.lists(st.integers(0, 5), max_size=12), min_size=1, max_size=8),
       scoped=st.lists(st.booleans(), min_size=8, max_size=8))
def test_real_loop_gets_every_event_in_order(ticks: list[list[int]], scoped: list[bool]) -> None:
    """An engine thread feeds six requests' events over ticks (some inside a scope, some not) to a running loop
    in another thread: each request sees exactly its events, in order."""
    sent: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    received: dict[str, list[int]] = {rid: [] for rid in sent}
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: (asyncio.set_event_loop(loop), ready.set(), loop.run_forever()))
    thread.start()
    ready.wait()
    try:
        delivery = loop_delivery(loop)
        callbacks = {rid: delivery.callback(lambda e, rid=rid: received[rid].extend(e.new_token_ids),
                                            lambda e: None) for rid in sent}
        counter = 0
        for tick, use_scope in zip(ticks, scoped):
            def emit(tick: list[int] = tick) -> None:
                nonlocal counter
                for i in tick:
                    rid = f"r{i}"
                    sent[rid].append(counter)
                    callbacks[rid](event(rid, counter))
                    counter += 1
            if use_scope:
                with batched_delivery():
                    emit()
            else:
                emit()
        done = threading.Event()
        loop.call_soon_threadsafe(done.set)
        assert done.wait(10)
        assert received == sent
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_two_feeding_threads_lose_nothing() -> None:
    loop = RecordingLoop()
    delivery = LoopDelivery(loop)  # type: ignore[arg-type]
    got: list[tuple[str, int]] = []
    lock = threading.Lock()

    def put(e: RequestEvent) -> None:
        with lock:
            got.append((e.request_id, e.new_token_ids[0]))

    def feed(rid: str) -> None:
        on_event = delivery.callback(put, lambda e: None)
        for tick in range(200):
            with batched_delivery():
                for k in range(5):
                    on_event(event(rid, tick * 5 + k))

    threads = [threading.Thread(target=feed, args=(rid,)) for rid in ("x", "y")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rid in ("x", "y"):
        assert [t for r, t in got if r == rid] == list(range(1000))
