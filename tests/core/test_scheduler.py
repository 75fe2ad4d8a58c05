"""ContinuousBatchScheduler driven tick by tick against the ReferenceBackend."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from gemmaserve.engine.request import Request, RequestEvent, RequestOutput, RequestState
from gemmaserve.engine.scheduler import ContinuousBatchScheduler
from gemmaserve.errors import EngineOverloadedError, InvalidRequestError, PromptTooLongError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings
from gemmaserve.testing.reference_backend import ReferenceBackend
from gemmaserve.testing.reference_model import EOS_ID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def make(
    backend: ReferenceBackend | None = None, *, cache_blocks: int = 64, block_size: int = 4, **overrides: int
) -> tuple[ContinuousBatchScheduler, ReferenceBackend, CacheManager | None]:
    backend = backend or ReferenceBackend()
    cache = CacheManager(cache_blocks, block_size) if cache_blocks else None
    backend.set_cache_adapter(cache)
    values = {"max_batch_size": 8, "prefill_chunk_tokens": 16, "max_active_kv_tokens": 4096, **overrides}
    return ContinuousBatchScheduler(backend, CoreSettings(**values), cache), backend, cache


def check_all(sched: ContinuousBatchScheduler) -> None:
    sched.check_integrity()
    sched.backend.check_integrity()
    if sched.cache_manager is not None:
        sched.cache_manager.check_integrity()


def assert_idle(sched: ContinuousBatchScheduler) -> None:
    """Nothing left anywhere: no requests, no KV rows, no reservations, no pinned cache blocks."""
    check_all(sched)
    backend = sched.backend
    assert not sched.has_work and sched.stats().reserved_kv_tokens == 0
    assert isinstance(backend, ReferenceBackend) and backend.num_live_rows == 0 and backend.num_reservations == 0
    if sched.cache_manager is not None:
        assert sched.cache_manager.stats().pinned_blocks == 0


class Recorder:
    """Collects events per request and checks the streaming contract (tokens once, final last)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, RequestOutput] = {}

    def feed(self, events: Iterable[RequestEvent]) -> None:
        for event in events:
            assert event.request_id not in self.outputs, "event after the final one"
            self.tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished:
                assert event.output is not None and event.output.token_ids == self.tokens[event.request_id]
                self.outputs[event.request_id] = event.output


def run(sched: ContinuousBatchScheduler, recorder: Recorder | None = None, max_ticks: int = 10_000) -> Recorder:
    recorder = recorder or Recorder()
    for _ in range(max_ticks):
        if not sched.has_work:
            break
        recorder.feed(sched.step())
        check_all(sched)
    assert not sched.has_work, "scheduler did not drain"
    return recorder


def req(rid: str, prompt: Iterable[int], **params: object) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(**params))  # type: ignore[arg-type]


# -- batch invariance --------------------------------------------------------------------------------

_request = st.tuples(
    st.lists(st.integers(5, 8), min_size=1, max_size=24),  # tiny alphabet: shared prefixes hit the cache
    st.integers(1, 12),  # max_tokens
    st.integers(0, 6),  # arrival tick
    st.sampled_from([0.0, 0.0, 0.8, 1.5]),  # temperature
    st.integers(0, 3),  # seed
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(_request, min_size=1, max_size=6),
    chunk=st.integers(1, 9),
    batch=st.integers(1, 4),
    block_size=st.integers(1, 4),
    cache_blocks=st.sampled_from([0, 3, 8, 64]),
)
def test_tokens_do_not_depend_on_batch_or_arrival(
    requests: list[tuple[list[int], int, int, float, int]], chunk: int, batch: int, block_size: int, cache_blocks: int
) -> None:
    sched, backend, _ = make(
        cache_blocks=cache_blocks, block_size=block_size, prefill_chunk_tokens=chunk, max_batch_size=batch
    )
    recorder, params = run_arrivals(sched, requests)
    for rid, (prompt, sampling) in params.items():
        assert recorder.outputs[rid].token_ids == backend.reference_generate(prompt, sampling), rid
    assert_idle(sched)


def run_arrivals(
    sched: ContinuousBatchScheduler, requests: list[tuple[list[int], int, int, float, int]]
) -> tuple[Recorder, dict[str, tuple[list[int], SamplingParams]]]:
    """Tick ``sched`` until it drains, adding each ``(prompt, max_tokens, arrival tick, temperature, seed)``
    at its tick (id = its index); checks integrity every tick. Returns the events and each id's params."""
    recorder = Recorder()
    params: dict[str, tuple[list[int], SamplingParams]] = {}
    last = max(arrival for _, _, arrival, _, _ in requests)
    for tick in itertools.count():
        for index, (prompt, max_tokens, arrival, temperature, seed) in enumerate(requests):
            if arrival == tick:
                params[str(index)] = (prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
                sched.add_request(Request(str(index), tuple(prompt), params[str(index)][1]))
        if tick > last and not sched.has_work:
            return recorder, params
        assert tick < 10_000, "scheduler did not drain"
        recorder.feed(sched.step())
        check_all(sched)
    raise AssertionError("unreachable")


# -- validation and overload ------------------------------------------------------------------------------


def test_invalid_requests_are_rejected_with_actionable_errors() -> None:
    sched, _, _ = make()
    with pytest.raises(InvalidRequestError, match="empty"):
        sched.add_request(req("a", []))
    with pytest.raises(InvalidRequestError, match=r"position 1 .*\[0, 64\)"):
        sched.add_request(req("b", [5, 64]))
    with pytest.raises(InvalidRequestError, match="token"):
        sched.add_request(req("c", [5, True]))  # type: ignore[list-item]
    sched.add_request(req("d", [5]))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(req("d", [6]))


def test_too_long_prompt_is_rejected_while_running_requests_finish() -> None:
    sched, backend, _ = make(ReferenceBackend(max_model_len=64), max_active_kv_tokens=60)
    sched.add_request(req("ok", [5, 6, 7], max_tokens=20, ignore_eos=True))
    recorder = Recorder()
    recorder.feed(sched.step())
    with pytest.raises(
        PromptTooLongError, match=r"50 tokens\) \+ max_tokens \(20\) = 70 .*maximum model length \(64\)"
    ):
        sched.add_request(req("long", [5] * 50, max_tokens=20))
    with pytest.raises(PromptTooLongError, match=r"MAX_ACTIVE_KV_TOKENS \(60\); lower max_tokens to at most 10"):
        sched.add_request(req("budget", [5] * 50, max_tokens=12))
    with pytest.raises(PromptTooLongError, match="shorten the prompt to under 64"):
        sched.add_request(req("huge", [5] * 70, max_tokens=1))
    run(sched, recorder)
    assert recorder.outputs["ok"].token_ids == backend.reference_generate(
        [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True)
    )
    assert set(recorder.outputs) == {"ok"}


def test_settings_max_model_len_caps_requests() -> None:
    sched, _, _ = make(max_model_len=10)
    with pytest.raises(PromptTooLongError, match=r"\(10\)"):
        sched.add_request(req("a", [5] * 5, max_tokens=6))
    sched.add_request(req("b", [5] * 5, max_tokens=5, ignore_eos=True))  # exactly the limit fits
    assert len(run(sched).outputs["b"].token_ids) == 5


def test_a_max_model_len_beyond_the_models_context_is_refused() -> None:
    """As vLLM does: MAX_MODEL_LEN above the model's context is a ConfigurationError naming both (it used to be
    lowered with a warning); at the model's context exactly it is accepted."""
    from gemmaserve.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"MAX_MODEL_LEN=65 .* exceeds the model's context of 64 tokens"):
        make(ReferenceBackend(max_model_len=64), max_model_len=65)
    sched, _, _ = make(ReferenceBackend(max_model_len=64), max_model_len=64)
    assert sched.max_model_len == 64


def test_queue_bound_raises_overloaded() -> None:
    sched, _, _ = make(max_waiting_requests=2, max_batch_size=1)
    sched.add_request(req("a", [5]))
    sched.add_request(req("b", [5]))
    with pytest.raises(EngineOverloadedError, match="MAX_WAITING_REQUESTS=2"):
        sched.add_request(req("c", [5]))
    recorder = Recorder()
    recorder.feed(sched.step())  # admits "a": room for one more
    sched.add_request(req("c", [5]))
    assert set(run(sched, recorder).outputs) == {"a", "b", "c"}
    assert_idle(sched)


def test_admission_respects_batch_size_and_kv_budget() -> None:
    sched, _, _ = make(max_batch_size=3, max_active_kv_tokens=50)
    for index in range(6):
        sched.add_request(req(str(index), [5, 6, 7, 8], max_tokens=16, ignore_eos=True))  # budget 20 each
    peak = 0
    while sched.has_work:
        sched.step()
        stats = sched.stats()
        peak = max(peak, stats.num_prefilling + stats.num_decoding)
        assert stats.reserved_kv_tokens <= 50
    assert peak == 2 and sched.stats().finished == {"length": 6}


# -- cancellation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("reserving", [False, True])
def test_cancel_in_every_phase_frees_everything(reserving: bool) -> None:
    backend = ReferenceBackend(kv_capacity_tokens=1000 if reserving else None)
    sched, backend, _ = make(backend, max_batch_size=2, prefill_chunk_tokens=3)
    prompt = list(range(5, 20))
    sched.add_request(req("decoding", prompt[:4], max_tokens=50, ignore_eos=True))
    sched.add_request(req("prefilling", prompt, max_tokens=50))
    sched.add_request(req("waiting", prompt, max_tokens=50))
    sched.add_request(req("fresh", [5], max_tokens=50))
    recorder = Recorder()
    recorder.feed(sched.step())
    recorder.feed(sched.step())
    states = {r.request_id: r.state for r in sched.live_requests()}
    assert states == {
        "decoding": RequestState.DECODING,
        "prefilling": RequestState.PREFILLING,
        "waiting": RequestState.WAITING,
        "fresh": RequestState.WAITING,
    }
    for rid in ("prefilling", "decoding", "waiting"):
        recorder.feed(sched.abort_request(rid))
        check_all(sched)
        assert recorder.outputs[rid].finish_reason == "cancelled"
    assert len(recorder.outputs["decoding"].token_ids) >= 2 and recorder.outputs["waiting"].token_ids == []
    assert sched.abort_request("decoding") == []  # already finished: no-op
    recorder.feed(sched.step())  # "fresh" is admitted and prefilled
    recorder.feed(sched.abort_all())
    assert recorder.outputs["fresh"].finish_reason == "cancelled"
    assert_idle(sched)


# -- prefill scheduling ----------------------------------------------------------------------------------


def test_chunked_prefill_interleaves_with_decode() -> None:
    backend = ReferenceBackend()
    chunks: list[int] = []
    original = backend.prefill_chunk

    def recording_chunk(state, num_tokens):  # type: ignore[no-untyped-def]
        chunks.append(min(num_tokens, state.num_remaining))
        original(state, num_tokens)

    backend.prefill_chunk = recording_chunk  # type: ignore[method-assign]
    sched, _, _ = make(backend, cache_blocks=0, prefill_chunk_tokens=4)
    sched.add_request(req("short", [5, 6], max_tokens=30, ignore_eos=True))
    recorder = Recorder()
    recorder.feed(sched.step())
    sched.add_request(req("long", list(range(5, 45)), max_tokens=2, ignore_eos=True))  # 40 tokens = 10 chunks
    per_tick = []
    for _ in range(10):
        before = len(recorder.tokens.get("short", []))
        events = sched.step()
        recorder.feed(events)
        per_tick.append((len(recorder.tokens["short"]) - before, "long" in recorder.tokens))
    assert all(new == 1 for new, _ in per_tick), "the decoding request stalled during a chunked prefill"
    assert [seen for _, seen in per_tick] == [False] * 9 + [True]  # first token after the 10th chunk
    assert chunks[1:] == [4] * 10
    run(sched, recorder)
    assert recorder.outputs["long"].token_ids == backend.reference_generate(
        list(range(5, 45)), SamplingParams(max_tokens=2, ignore_eos=True)
    )


def test_prefix_hits_are_reported_with_identical_tokens() -> None:
    sched, backend, cache = make(block_size=4)
    prompt = list(range(5, 19))  # 14 tokens: 3 full blocks + a tail
    sched.add_request(req("first", prompt, max_tokens=6))
    first = run(sched).outputs["first"]
    sched.add_request(req("second", prompt, max_tokens=6))
    sched.add_request(req("sibling", [*prompt[:9], 60, 61], max_tokens=6))
    outputs = run(sched).outputs
    assert first.cached_tokens == 0
    assert outputs["second"].cached_tokens == len(prompt) - 1  # full hit, last token recomputed
    assert outputs["sibling"].cached_tokens == 8  # two whole blocks shared
    assert outputs["second"].token_ids == first.token_ids
    assert outputs["sibling"].token_ids == backend.reference_generate(
        [*prompt[:9], 60, 61], SamplingParams(max_tokens=6)
    )
    stats = sched.stats()
    assert stats.cached_tokens == 13 + 8 and stats.prompt_tokens == 14 * 2 + 11
    assert cache is not None and cache.stats().hit_tokens >= 21
    assert_idle(sched)


def test_store_is_skipped_when_the_prefix_pool_has_no_room() -> None:
    sched, backend, _ = make(cache_blocks=0)
    sched.cache_manager = CacheManager(0, 4)
    backend.set_cache_adapter(sched.cache_manager)
    sched.add_request(req("a", [5, 6, 7, 8, 9], max_tokens=3))
    out = run(sched).outputs["a"]
    assert sched.stats().skipped_stores == 1 and out.cached_tokens == 0
    assert out.token_ids == backend.reference_generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=3))


# -- sampling and finishing -----------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_unseeded_gets_a_seed() -> None:
    outputs = []
    for companions in (0, 3):
        sched, _, _ = make()
        for index in range(companions):
            sched.add_request(req(f"other{index}", [7, 8, index + 5], max_tokens=9, temperature=1.0, seed=index))
        sched.add_request(req("seeded", [5, 6], max_tokens=12, temperature=1.3, top_p=0.9, top_k=20, seed=42))
        outputs.append(run(sched).outputs["seeded"].token_ids)
    assert outputs[0] == outputs[1]
    sched, _, _ = make()
    a, b = req("a", [5], temperature=1.0), req("b", [5], temperature=1.0)
    sched.add_request(a)
    sched.add_request(b)
    sched.step()
    assert a.seed is not None and b.seed is not None and a.seed != b.seed


def _eos_prompt(backend: ReferenceBackend) -> tuple[list[int], int]:
    """A prompt whose greedy continuation hits EOS early, and where."""
    for a, b, c in itertools.product(range(5, 30), repeat=3):
        tokens = backend.reference_generate([a, b, c], SamplingParams(max_tokens=8, ignore_eos=True))
        if EOS_ID in tokens[2:]:
            return [a, b, c], tokens.index(EOS_ID)
    raise AssertionError("no EOS prompt found")


def test_finish_reasons_eos_stop_and_length() -> None:
    sched, backend, _ = make()
    prompt, eos_at = _eos_prompt(backend)
    free = backend.reference_generate(prompt, SamplingParams(max_tokens=eos_at + 4, ignore_eos=True))
    stop_token = free[1]
    sched.add_request(req("eos", prompt, max_tokens=eos_at + 4))
    sched.add_request(req("ignore", prompt, max_tokens=eos_at + 4, ignore_eos=True))
    sched.add_request(req("stop", prompt, max_tokens=eos_at + 4, stop_token_ids=(stop_token,)))
    sched.add_request(req("one", prompt, max_tokens=1))
    out = run(sched).outputs
    assert (out["eos"].finish_reason, out["eos"].token_ids) == ("stop", free[: eos_at + 1])
    assert (out["ignore"].finish_reason, out["ignore"].token_ids) == ("length", free)
    assert (out["stop"].finish_reason, out["stop"].token_ids) == ("stop", free[: free.index(stop_token) + 1])
    assert (out["one"].finish_reason, len(out["one"].token_ids)) == ("length", 1)
    metrics = out["ignore"].metrics
    assert metrics.ttft is not None and metrics.e2e is not None and metrics.e2e >= metrics.ttft
    assert metrics.tpot is not None and out["one"].metrics.tpot is None
    assert_idle(sched)


def test_logprobs_match_the_model() -> None:
    from gemmaserve.engine.sampling_cpu import log_softmax
    from gemmaserve.testing.reference_model import KVEntry, next_token_logits

    sched, _, _ = make()
    request = Request("lp", (5, 6, 7), SamplingParams(max_tokens=4, temperature=0.7, seed=1), want_logprobs=True)
    sched.add_request(request)
    sched.add_request(req("plain", [5, 6], max_tokens=4))
    out = run(sched).outputs
    assert out["plain"].logprobs is None
    lp = out["lp"]
    assert lp.logprobs is not None and len(lp.logprobs) == 4
    context = [5, 6, 7]
    for token, logprob in zip(lp.token_ids, lp.logprobs):
        logits = next_token_logits([KVEntry(t, i) for i, t in enumerate(context)], 64)
        assert logprob == pytest.approx(log_softmax(logits)[token])
        context.append(token)


# -- failures --------------------------------------------------------------------------------------------


def test_prefill_failure_fails_only_that_request() -> None:
    sched, backend, _ = make(ReferenceBackend(fail_on_token=40), prefill_chunk_tokens=3)
    sched.add_request(req("good", [5, 6, 7, 8], max_tokens=8, ignore_eos=True))
    sched.add_request(req("bad", [5, 6, 7, 8, 9, 10, 40, 11], max_tokens=8))
    sched.add_request(req("later", [9, 9], max_tokens=3))
    out = run(sched).outputs
    assert out["bad"].finish_reason == "error" and out["bad"].error_type == "BackendStepError"
    assert "prefill" in (out["bad"].error or "") and "injected" in (out["bad"].error or "")
    for rid, prompt, n in (("good", [5, 6, 7, 8], 8), ("later", [9, 9], 3)):
        assert out[rid].token_ids == backend.reference_generate(
            prompt, SamplingParams(max_tokens=n, ignore_eos=rid == "good")
        )
    assert_idle(sched)


def test_decode_failure_fails_only_the_failing_row_and_serving_continues() -> None:
    backend = ReferenceBackend()
    poison_prompt = [5, 6, 7]
    tokens = backend.reference_generate(poison_prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    backend.fail_on_decode_token = tokens[3]  # raised when the 4th token is fed back
    bystander = backend.reference_generate([8, 8], SamplingParams(max_tokens=40, ignore_eos=True))
    assert tokens[3] not in bystander
    sched, _, _ = make(backend)
    sched.add_request(req("poison", poison_prompt, max_tokens=10, ignore_eos=True))
    sched.add_request(req("bystander", [8, 8], max_tokens=40, ignore_eos=True))
    recorder = run(sched)
    poison = recorder.outputs["poison"]
    assert poison.finish_reason == "error" and "decode" in (poison.error or "") and "injected" in (poison.error or "")
    assert poison.token_ids == tokens[:4]
    assert recorder.outputs["bystander"].finish_reason == "length"
    assert recorder.outputs["bystander"].token_ids == bystander  # retried alone, then carried on unchanged
    stats = sched.stats()
    assert stats.decode_failures == 1 and stats.decode_rows_retried == 2
    backend.fail_on_decode_token = None
    sched.add_request(req("after", [8, 8], max_tokens=5, ignore_eos=True))
    assert run(sched).outputs["after"].token_ids == backend.reference_generate(
        [8, 8], SamplingParams(max_tokens=5, ignore_eos=True)
    )
    assert_idle(sched)


def test_kv_reservation_gates_admission_and_rejects_impossible_requests() -> None:
    sched, _backend, _ = make(ReferenceBackend(kv_capacity_tokens=40), max_active_kv_tokens=1000)
    sched.add_request(req("a", [5] * 10, max_tokens=15, ignore_eos=True))  # 25 tokens
    sched.add_request(req("b", [6] * 10, max_tokens=15, ignore_eos=True))  # must wait for "a"
    sched.add_request(req("huge", [7] * 10, max_tokens=100))  # more than the pool holds
    recorder = Recorder()
    recorder.feed(sched.step())
    assert sched.num_running == 1 and sched.num_waiting == 2
    run(sched, recorder)
    assert recorder.outputs["huge"].error_type == "KVCapacityError" and "40" in (recorder.outputs["huge"].error or "")
    assert recorder.outputs["a"].finish_reason == recorder.outputs["b"].finish_reason == "length"
    assert_idle(sched)


# -- streaming-only backends ------------------------------------------------------------------------------


def test_streaming_only_backend_runs_through_generate_stream() -> None:
    backend = ReferenceBackend(streaming_only=True, max_concurrent_streams=2)
    sched, _, _ = make(backend)
    cases = {
        str(i): ([5 + i, 6, 7], SamplingParams(max_tokens=6 + i, temperature=0.5 * (i % 2), seed=i)) for i in range(4)
    }
    for rid, (prompt, params) in cases.items():
        sched.add_request(Request(rid, tuple(prompt), params))
    recorder = Recorder()
    while sched.has_work:
        recorder.feed(sched.step())
        assert sched.num_running <= 2
        check_all(sched)
    for rid, (prompt, params) in cases.items():
        assert recorder.outputs[rid].token_ids == backend.reference_generate(prompt, params)
    sched.add_request(req("cut", [5, 6], max_tokens=50, ignore_eos=True))
    sched.step()
    sched.step()
    assert [e.output.finish_reason for e in sched.abort_request("cut") if e.output] == ["cancelled"]
    assert_idle(sched)


@pytest.mark.parametrize("failing", ["sample", "splice_into_batched"])
def test_the_default_generate_stream_frees_its_row_when_the_first_step_fails(failing: str) -> None:
    """``InferenceBackend.generate_stream``: a raise between the prefill and the row joining its batch of one frees
    the prefilled row (it leaked: one live row after the request had ended with an error)."""
    backend = ReferenceBackend(streaming_only=True)
    original = getattr(backend, failing)
    fail = [True]

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        if fail[0]:
            fail[0] = False
            raise RuntimeError(f"{failing} failed")
        return original(*args, **kwargs)

    setattr(backend, failing, flaky)
    sched, _, _ = make(backend)
    sched.add_request(req("a", [5, 6, 7], max_tokens=3))
    recorder = Recorder()
    while sched.has_work:
        recorder.feed(sched.step())
    assert recorder.outputs["a"].finish_reason == "error" and not fail[0]
    assert backend.num_live_rows == 0
    sched.add_request(req("b", [5, 6, 7], max_tokens=3))
    while sched.has_work:
        recorder.feed(sched.step())
    assert recorder.outputs["b"].finish_reason == "length"
    assert_idle(sched)


def test_failed_row_removal_drops_the_batch_and_serving_continues() -> None:
    backend = ReferenceBackend()
    original = backend.remove_row_from_cache
    failures = [RuntimeError("device lost the row")]

    def flaky_remove(batched, row_idx):  # type: ignore[no-untyped-def]
        if failures:
            raise failures.pop()
        original(batched, row_idx)

    backend.remove_row_from_cache = flaky_remove  # type: ignore[method-assign]
    sched, _, _ = make(backend)
    sched.add_request(req("short", [5], max_tokens=2, ignore_eos=True))
    sched.add_request(req("long", [6], max_tokens=20, ignore_eos=True))
    out = run(sched).outputs
    assert out["short"].finish_reason == "length"  # it had finished; only its removal failed
    assert out["long"].finish_reason == "error" and "row removal" in (out["long"].error or "")
    sched.add_request(req("after", [7, 7], max_tokens=4, ignore_eos=True))
    assert run(sched).outputs["after"].token_ids == backend.reference_generate(
        [7, 7], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    sched.check_integrity()
