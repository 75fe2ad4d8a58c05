"""A constrained request's token taken ahead (deferred sampling) advances its constraint in place and is rolled
back whenever that token is not the one appended: every mask the request hands to sampling equals the mask of a
fresh constraint fed exactly the tokens appended so far (plus the token taken ahead, for ``ahead=1``), whatever
order of take-ahead, append, forgetting and mismatched appends the scheduler goes through."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaserve.engine.request import Request
from gemmaserve.sampling_params import SamplingParams, allowed_tokens

pytest.importorskip("llguidance")

_VOCAB = 64
_SPECS = [{"regex": "[a-c]{2,9}"}, {"choice": ["abc", "abd", "bca"]},
          {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]


def _compiler():
    from gemmaserve.structured import GrammarCompiler
    from gemmaserve.testing.reference_backend import ReferenceBackend

    backend = ReferenceBackend(vocab_size=_VOCAB)
    return GrammarCompiler(backend.tokenizer, _VOCAB, backend.model_info.eos_token_ids), backend


_COMPILER, _BACKEND = _compiler()


def _oracle_mask(spec: dict, tokens: list[int]) -> bytes | None:
    """The mask after ``tokens`` on a fresh constraint, or None when one of them is rejected."""
    from gemmaserve.structured import StructuredOutputs
    from gemmaserve.structured.grammar import ConstraintError

    constraint = _COMPILER.compile(StructuredOutputs(**spec))
    try:
        for token in tokens:
            if constraint.accept(token):
                return None  # complete: no mask follows
        return constraint.allowed()
    except ConstraintError:
        return None


def _pick(mask: bytes | None, choice: int) -> int:
    allowed = [t for t, ok in enumerate(allowed_tokens(mask, _VOCAB)) if ok] if mask else []
    return allowed[choice % len(allowed)] if allowed else choice % _VOCAB


_ops = st.lists(st.tuples(st.sampled_from(["ahead_then_append", "ahead_then_forget", "ahead_then_other",
                                           "append", "ahead_invalid_then_forget"]),
                          st.integers(0, 1000), st.integers(0, 1000)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(_SPECS), ops=_ops)
def test_masks_after_tokens_taken_ahead_equal_a_fresh_constraints(spec: dict, ops: list) -> None:
    from gemmaserve.structured import StructuredOutputs

    eos = tuple(_BACKEND.model_info.eos_token_ids)
    request = Request("r", (5, 6), SamplingParams(max_tokens=100, structured_outputs=spec))
    request.seed = 1
    request.constraint = _COMPILER.compile(StructuredOutputs(**spec))
    for op, first, second in ops:
        if request.is_finished:
            break
        now = request.row_sampling().allowed
        assert now == _oracle_mask(spec, request.output_token_ids)
        token = _pick(now, first)
        if op == "ahead_invalid_then_forget":
            token = next((t for t, ok in enumerate(allowed_tokens(now or b"", _VOCAB)) if not ok), token)
        request.take_ahead(token)
        expected_next = _oracle_mask(spec, [*request.output_token_ids, token])
        following = request.row_sampling(ahead=1).allowed
        if expected_next is not None:
            assert following == expected_next
        if op == "ahead_then_append" or op == "append":
            request.append_token(token, None, eos)
        elif op == "ahead_then_other":
            request.append_token(_pick(now, second), None, eos)  # another token than the one taken ahead
        # forget: the step that sampled ``token`` failed; the next sampling asks for ahead=0
        if not request.is_finished:
            assert request.row_sampling().allowed == _oracle_mask(spec, request.output_token_ids)


_batch_rows = st.lists(st.tuples(st.sampled_from(_SPECS + [{"regex": "[A-Z]+"}]),  # the last one is stuck
                                 st.sampled_from(["ahead", "fresh", "stale_ahead"]), st.integers(0, 1000),
                                 st.integers(0, 3)), min_size=2, max_size=6)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_batch_rows)
def test_row_samplings_built_while_the_masks_are_computed_equal_the_serial_ones(rows: list) -> None:
    """The deferred tick's order (masks started on the mask thread, row samplings built meanwhile, then waited
    for, the rows it returns built again) gives every row the sampling the serial order gives: the mask of a
    fresh constraint fed its tokens, an empty mask for a constraint no token can continue, and a token taken
    ahead by a failed step forgotten for ``ahead=0``."""
    from gemmaserve.engine.request import prepare_masks, start_masks
    from gemmaserve.structured import StructuredOutputs

    eos = tuple(_BACKEND.model_info.eos_token_ids)

    def build() -> list[tuple[Request, int]]:
        built = []
        for i, (spec, kind, choice, warmup) in enumerate(rows):
            request = Request(f"r{i}", (5, 6), SamplingParams(max_tokens=100, structured_outputs=spec))
            request.seed = i
            request.constraint = _COMPILER.compile(StructuredOutputs(**spec))
            for _ in range(warmup):  # some tokens appended first
                mask = request.row_sampling().allowed
                if request.is_finished or not mask:
                    break
                request.append_token(_pick(mask, choice), None, eos)
            ahead = 0
            if kind != "fresh" and not request.is_finished:
                request.take_ahead(_pick(request.row_sampling().allowed, choice + 1))
                ahead = int(kind == "ahead")  # stale_ahead: the step that sampled it failed (ahead=0 now)
            built.append((request, ahead))
        return built

    serial = build()
    for request, ahead in serial:
        if not ahead:
            request.row_sampling()  # forgets a stale token before the masks, as start_masks does
    prepare_masks(request for request, _ in serial)
    expected = [request.row_sampling(ahead=ahead) for request, ahead in serial]
    overlapped = build()
    pending = start_masks(overlapped)
    got = [request.row_sampling(ahead=ahead) for request, ahead in overlapped]
    redo = pending.wait()
    got = [request.row_sampling(ahead=ahead) if id(request) in redo else sampling
           for (request, ahead), sampling in zip(overlapped, got)]
    assert [bytes(s.allowed) if s.allowed is not None else None for s in got] == \
           [bytes(s.allowed) if s.allowed is not None else None for s in expected]
    assert [s.step for s in got] == [s.step for s in expected]
    for (request, ahead), (reference, _) in zip(overlapped, serial):
        assert str(request.constraint_error) == str(reference.constraint_error)
        if ahead and request._ahead is not None:
            assert str(request._ahead.mask_error) == str(reference._ahead.mask_error)


def _fresh_requests() -> list[Request]:
    """One request per spec of _SPECS, its constraint at the start, nothing generated."""
    from gemmaserve.structured import StructuredOutputs

    requests = []
    for i, spec in enumerate(_SPECS):
        request = Request(f"r{i}", (5, 6), SamplingParams(max_tokens=100, structured_outputs=spec))
        request.seed, request.constraint = i, _COMPILER.compile(StructuredOutputs(**spec))
        requests.append(request)
    return requests


def test_a_failed_native_mask_call_leaves_every_row_to_compute_its_own(monkeypatch) -> None:
    """When llguidance's batch call raises, ``wait`` names every row of the batch and clears their half-written
    masks: their row samplings, built again, carry the masks each constraint computes alone."""
    from gemmaserve.engine.request import start_masks
    from gemmaserve.structured import grammar

    class Broken:
        def unsafe_compute_mask_ptr(self, *args: object) -> None:
            raise RuntimeError("injected")

    monkeypatch.setattr(grammar, "_executor", Broken())
    requests = _fresh_requests()
    pending = start_masks((request, 0) for request in requests)
    assert pending.wait() == {id(request) for request in requests}
    for request, spec in zip(requests, _SPECS):
        assert request.row_sampling().allowed == _oracle_mask(spec, [])


def test_the_mask_thread_is_started_again_in_a_process_that_lacks_it(monkeypatch) -> None:
    """A forked child has no threads: a mask thread recorded under another process id is replaced, and the
    masks still arrive (no wait on a thread that does not exist)."""
    from gemmaserve.structured import StructuredOutputs, grammar

    constraints = [_COMPILER.compile(StructuredOutputs(**spec)) for spec in _SPECS]
    first = grammar._mask_thread()
    monkeypatch.setattr(first, "pid", -1)
    masks = grammar.allowed_many(constraints)
    assert grammar._mask_thread() is not first
    assert [bytes(m) for m in masks] == [c.allowed() for c in constraints]


def test_a_batch_the_mask_thread_does_not_take_in_time_is_given_up_and_never_computed(monkeypatch) -> None:
    """A stalled mask thread cannot hang the engine: the submitter gives the batch up after the pick-up timeout
    (start_masks then leaves every row to compute its own mask), and the thread, when it gets there, leaves that
    batch alone (its constraints are the engine thread's again)."""
    import os
    import queue
    import threading

    from gemmaserve.engine.request import start_masks
    from gemmaserve.structured import grammar

    monkeypatch.setattr(grammar, "_PICKUP_TIMEOUT_S", 0.05)
    gate = threading.Event()
    stalled = grammar._MaskThread.__new__(grammar._MaskThread)  # a thread stuck before its next job
    stalled._jobs, stalled.pid = queue.SimpleQueue(), os.getpid()
    stalled.thread = threading.Thread(target=lambda: (gate.wait(), stalled._jobs.get()._compute()), daemon=True)
    stalled.thread.start()
    monkeypatch.setattr(grammar, "_thread", stalled)
    requests = _fresh_requests()
    pending = start_masks((request, 0) for request in requests)
    assert pending.wait() == set()  # nothing was started: no mask view handed out
    assert [request.row_sampling().allowed for request in requests] == [_oracle_mask(spec, []) for spec in _SPECS]
    gate.set()
    stalled.thread.join(timeout=5)
    assert not stalled.thread.is_alive()
