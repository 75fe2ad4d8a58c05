"""One sampling definition on every backend (``gemmaserve.engine.sampling_cpu``): the torch implementation
(custom_torch and hf_torch share ``gemmaserve.torch_sampling``) and mlx's pick the pure-Python definition's
token for the same logits, (seed, step), temperature, top-k and top-p; end to end, one seed gives the same
text on custom-cpu, hf and mlx (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from gemmaserve.engine.sampling_cpu import sample_row, top_logprobs  # noqa: E402
from gemmaserve.sampling_params import RowSampling, SamplingParams  # noqa: E402
from gemmaserve.torch_sampling import sample_tokens  # noqa: E402


def _mlx_sample():
    try:
        import mlx.core as mx
        from gemmaserve_mlx.sampling import sample_tokens as mlx_sample_tokens
    except ImportError:
        return None
    return lambda logits, rows: mlx_sample_tokens(mx.array(logits.numpy()), rows).tolist()


_row = st.tuples(
    st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7]),  # temperature
    st.sampled_from([1.0, 0.95, 0.7, 0.3, 1e-9]),  # top_p
    st.sampled_from([0, 1, 5, 40]),  # top_k
    st.integers(0, 2**63 - 1),  # seed
    st.integers(0, 500),  # step
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_row, min_size=1, max_size=6), data_seed=st.integers(0, 2**31))
def test_torch_and_mlx_pick_the_definitions_token(rows, data_seed) -> None:
    generator = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(rows), 97, generator=generator) * 3  # fp32, as a model's logits
    samplings = [RowSampling(*row) for row in rows]
    expected = [sample_row([float(x) for x in logits[i]], samplings[i])[0] for i in range(len(rows))]
    assert sample_tokens(logits, samplings).token_ids == expected
    mlx = _mlx_sample()
    if mlx is not None:
        got = mlx(logits, samplings)
        # float32 in mlx against float64: a draw within ~1e-7 of a cumulative boundary may part (never here)
        assert got == expected


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(_row, st.sampled_from([0.0, 0.05, 0.3]), st.booleans()), min_size=1, max_size=6),
       data_seed=st.integers(0, 2**31), scale=st.sampled_from([0.25, 3.0]))
def test_half_precision_logits_sorted_in_their_own_dtype_pick_the_definitions_token(rows, data_seed, scale) -> None:
    """bfloat16 / float16 logits (a GPU model's) are sorted as they are, not widened first: with many exact ties
    (a coarse bfloat16 grid at scale 0.25), min_p, masks and a mix of greedy rows, the token is the definition's."""
    generator = torch.Generator().manual_seed(data_seed)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(len(rows), 300, generator=generator) * scale).to(dtype)
        samplings = []
        for (t, p, k, seed, step), min_p, masked in rows:
            mask = _pack(set(range(0, 300, 3)) | {1, 2}, 38) if masked else None
            samplings.append(RowSampling(t, p, k, seed, step, min_p=min_p, allowed=mask))
        expected = [sample_row([float(x) for x in logits[i]], samplings[i])[0] for i in range(len(rows))]
        assert sample_tokens(logits, samplings).token_ids == expected, dtype


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(_row, st.integers(0, 20), st.sampled_from(["none", "mask", "bias", "penalty"])),
                     min_size=1, max_size=5),
       data_seed=st.integers(0, 2**31), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_top_logprobs_are_the_definitions(rows, data_seed, dtype) -> None:
    """The k most likely alternatives of every row (some asking for none, masked, biased or penalized rows,
    bfloat16 ties) are the pure-Python definition's: same ids in the same order, same values."""
    generator = torch.Generator().manual_seed(data_seed)
    logits = (torch.randn(len(rows), 61, generator=generator) * 2).to(getattr(torch, dtype))
    samplings = []
    for (t, p, k, seed, step), wanted, kind in rows:
        extra: dict = {"top_logprobs": wanted}
        if kind == "mask":
            extra["allowed"] = _pack({1, 2, 3, 5, 8, 13, 21, 34, 55}, 8)
        elif kind == "bias":
            extra["logit_bias"] = ((3, 5.0), (7, -100.0))
        elif kind == "penalty":
            extra.update(repetition_penalty=1.3, frequency_penalty=0.5, output_counts=((4, 2), (9, 1)))
        samplings.append(RowSampling(t, p, k, seed, step, **extra))
    sampled = sample_tokens(logits, samplings, want_logprobs=True)
    assert (sampled.top_logprobs is None) == all(row.top_logprobs == 0 for row in samplings)
    for i, row in enumerate(samplings):
        expected = top_logprobs([float(x) for x in logits[i]], row)
        got = sampled.top_logprobs[i] if sampled.top_logprobs else []
        assert [t for t, _ in got] == [t for t, _ in expected], (row, got, expected)
        assert all(abs(a - b) < 1e-9 for (_, a), (_, b) in zip(got, expected))
        assert len(got) == (min(row.top_logprobs, 9) if row.allowed else row.top_logprobs)
        token, logprob = sampled.token_ids[i], sampled.logprobs[i]
        assert all(t != token or abs(v - logprob) < 1e-12 for t, v in got)  # the sampled token's own value


def _generate(path, backend: str, params: list[SamplingParams], prompts: list[list[int]]) -> list[list[int]]:
    from gemmaserve import LLM

    llm = LLM(str(path), backend=backend, device="cpu", dtype="float32", max_batch_size=4)
    try:
        return [out.token_ids for out in llm.generate(prompts, params)]
    finally:
        llm.close()


def test_one_seed_gives_the_same_tokens_on_every_backend(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny_gemma4

    path = build_tiny_gemma4(tmp_path / "ckpt")
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randrange(3, 12))] for _ in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=t, top_p=p, top_k=k, seed=s, ignore_eos=True)
              for t, p, k, s in [(0.9, 0.95, 0, 1), (1.3, 1.0, 20, 2), (0.7, 0.8, 5, 3), (0.0, 1.0, 0, 4)]]
    params += [  # min_p, logit_bias (greedy and sampled), min_tokens
        SamplingParams(max_tokens=10, temperature=1.2, min_p=0.2, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, logit_bias={7: 100.0}, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, seed=6, logit_bias={11: 5.0, 12: -100.0}, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8, stop_token_ids=[prompts[0][0]]),
        SamplingParams(max_tokens=10, temperature=0.9, seed=7, repetition_penalty=1.4, presence_penalty=0.5,
                       frequency_penalty=0.3, ignore_eos=True),  # penalties
        SamplingParams(max_tokens=8, temperature=1.1, seed=8, allowed_token_ids=[9, 40, 41, 300], ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=[17, 250], ignore_eos=True),  # allowed ids
    ]
    prompts = (prompts * 4)[: len(params)]
    backends = ["custom-cpu", "hf"]
    if _mlx_sample() is not None:
        backends.append("mlx")
    runs = {name: _generate(path, name, params, prompts) for name in backends}
    for name in backends[1:]:
        assert runs[name] == runs["custom-cpu"], name
    for param, tokens in zip(params, runs["custom-cpu"]):
        if param.allowed_token_ids is not None:
            assert tokens and set(tokens) <= set(param.allowed_token_ids), tokens


_adjusted_row = st.tuples(
    st.sampled_from([0.0, 0.5, 1.0, 1.5]),  # temperature
    st.sampled_from([1.0, 0.9, 0.5]),  # top_p
    st.sampled_from([0, 3, 30]),  # top_k
    st.integers(0, 2**63 - 1),  # seed
    st.integers(0, 50),  # step
    st.sampled_from([0.0, 0.05, 0.3, 0.9]),  # min_p
    st.lists(st.tuples(st.integers(0, 96), st.sampled_from([-100.0, -3.0, 2.5, 8.0])), max_size=4),  # logit_bias
    st.lists(st.integers(0, 96), max_size=3),  # banned
)


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_adjusted_row, min_size=1, max_size=5), data_seed=st.integers(0, 2**31))
def test_min_p_logit_bias_and_bans_agree_across_implementations(rows, data_seed) -> None:
    generator = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(rows), 97, generator=generator) * 3
    samplings = [RowSampling(t, p, k, seed, step, min_p, tuple(dict(bias).items()), tuple(sorted(set(banned))))
                 for t, p, k, seed, step, min_p, bias, banned in rows]
    expected = [sample_row([float(x) for x in logits[i]], row, want_logprob=True) for i, row in enumerate(samplings)]
    got = sample_tokens(logits, samplings, want_logprobs=True)
    assert got.token_ids == [token for token, _ in expected]
    assert got.logprobs == pytest.approx([logprob for _, logprob in expected], abs=1e-9)
    assert not any(token in row.banned for token, row in zip(got.token_ids, samplings))
    mlx = _mlx_sample()
    if mlx is not None:
        assert mlx(logits, samplings) == got.token_ids


def test_min_p_keeps_what_transformers_keeps() -> None:
    """With temperature, top-k and top-p, the tokens min_p leaves drawable are those transformers' warpers
    (in generate's order) leave finite."""
    transformers = pytest.importorskip("transformers")
    from gemmaserve.engine.sampling_cpu import _filtered_probs

    generator = torch.Generator().manual_seed(3)
    for case in range(40):
        logits = torch.randn(1, 200, generator=generator, dtype=torch.float64) * 2
        temperature, top_k, top_p, min_p = [(0.7, 0, 1.0, 0.1), (1.0, 50, 0.9, 0.05), (1.3, 0, 0.95, 0.2),
                                            (0.5, 20, 1.0, 0.5)][case % 4]
        warpers = transformers.LogitsProcessorList([
            transformers.TemperatureLogitsWarper(temperature),
            *([transformers.TopKLogitsWarper(top_k)] if top_k else []),
            *([transformers.TopPLogitsWarper(top_p)] if top_p < 1.0 else []),
            transformers.MinPLogitsWarper(min_p),
        ])
        kept_hf = set(torch.isfinite(warpers(torch.zeros(1, 1, dtype=torch.long), logits.clone()))[0].nonzero()[:, 0].tolist())
        row = RowSampling(temperature, top_p, top_k, 0, 0, min_p)
        kept = {token for token, p in _filtered_probs([float(x) for x in logits[0]], row) if p > 0}
        assert kept == kept_hf, case


def test_min_tokens_and_logit_bias_through_the_scheduler() -> None:
    """min_tokens: no EOS before it (a request that would stop at once runs on); logit_bias 100 forces a token."""
    from gemmaserve.engine.request import Request
    from gemmaserve.engine.scheduler import ContinuousBatchScheduler
    from gemmaserve.settings import CoreSettings
    from gemmaserve.testing.reference_backend import ReferenceBackend
    from gemmaserve.testing.reference_model import EOS_ID

    backend = ReferenceBackend(async_decode=True)
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = [[5 + i % 3, 6, 7 + i % 2, 5 + i] for i in range(40)]
    early = next((p for p in prompts if backend.reference_generate(p, greedy)[-1] == EOS_ID
                  and len(backend.reference_generate(p, greedy)) < 6), None)
    if early is None:
        pytest.skip("no prompt of the toy model stops within 6 tokens")
    sched = ContinuousBatchScheduler(backend, CoreSettings(max_batch_size=4, max_active_kv_tokens=4096))
    params = {
        "min": SamplingParams(max_tokens=12, temperature=0.0, min_tokens=8),
        "bias": SamplingParams(max_tokens=5, temperature=0.9, seed=2, logit_bias={"9": 100.0}),
    }
    requests = {rid: Request(rid, tuple(early), p) for rid, p in params.items()}
    for request in requests.values():
        sched.add_request(request)
    while sched.has_work:
        sched.step()
        sched.check_integrity()
    minimum = requests["min"].output_token_ids
    assert len(minimum) >= 8 and EOS_ID not in minimum[:8]
    assert minimum == backend.reference_generate(early, params["min"])
    assert requests["bias"].output_token_ids == [9] * 5


def _pack(allowed: set[int], nbytes: int) -> bytes:
    mask = bytearray(nbytes)
    for token in allowed:
        mask[token >> 3] |= 1 << (token & 7)
    return bytes(mask)


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(_row, st.sets(st.integers(0, 96), min_size=1, max_size=8), st.integers(0, 3)),
                     min_size=1, max_size=5), data_seed=st.integers(0, 2**31))
def test_allowed_masks_agree_across_implementations_and_only_allowed_tokens_are_picked(rows, data_seed) -> None:
    """Structured output's per-row mask (some rows unconstrained, masks shorter or longer than the vocabulary):
    torch and mlx pick the definition's token, always one the mask allows."""
    generator = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(rows), 97, generator=generator) * 3
    samplings = []
    for (t, p, k, seed, step), allowed, shape in rows:
        mask = None if shape == 0 else _pack(allowed, {1: 13, 2: 16, 3: 40}[shape])  # 13 bytes = 104 tokens
        samplings.append(RowSampling(t, p, k, seed, step, allowed=mask))
    expected = [sample_row([float(x) for x in logits[i]], row)[0] for i, row in enumerate(samplings)]
    got = sample_tokens(logits, samplings).token_ids
    assert got == expected
    for token, ((_, allowed, shape), row) in zip(got, zip(rows, samplings)):
        assert row.allowed is None or token in allowed
    mlx = _mlx_sample()
    if mlx is not None:
        assert mlx(logits, samplings) == got


_penalized_row = st.tuples(
    _row, st.sampled_from([1.0, 0.7, 1.3, 2.0]), st.sampled_from([0.0, -1.5, 0.8]), st.sampled_from([0.0, 0.4, 2.0]),
    st.frozensets(st.integers(0, 110), max_size=6), st.dictionaries(st.integers(0, 110), st.integers(1, 5), max_size=6))


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_penalized_row, min_size=1, max_size=5), data_seed=st.integers(0, 2**31))
def test_penalties_agree_across_implementations(rows, data_seed) -> None:
    """repetition / presence / frequency penalties (ids past the vocabulary ignored): torch and mlx pick the
    definition's token; logprobs follow the penalized distribution."""
    generator = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(rows), 97, generator=generator) * 3
    samplings = [RowSampling(t, p, k, seed, step, repetition_penalty=rp, presence_penalty=pp, frequency_penalty=fp,
                             prompt_tokens=prompt, output_counts=tuple(sorted(counts.items())))
                 for (t, p, k, seed, step), rp, pp, fp, prompt, counts in rows]
    expected = [sample_row([float(x) for x in logits[i]], row, want_logprob=True) for i, row in enumerate(samplings)]
    got = sample_tokens(logits, samplings, want_logprobs=True)
    assert got.token_ids == [token for token, _ in expected]
    assert got.logprobs == pytest.approx([logprob for _, logprob in expected], abs=1e-9)
    mlx = _mlx_sample()
    if mlx is not None:
        assert mlx(logits, samplings) == got.token_ids


def test_repetition_penalty_matches_transformers_generate(tmp_path) -> None:
    """Greedy with repetition_penalty gives transformers' tokens (its RepetitionPenaltyLogitsProcessor has the
    same definition over prompt + output) on custom-cpu and hf."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tiny_checkpoints import build_tiny_gemma4

    path = build_tiny_gemma4(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [[5, 9, 9, 13, 5], [17, 4, 4, 4, 21, 33, 17]]
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.6, ignore_eos=True)
    want = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.6,
                             eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    for backend in ("custom-cpu", "hf"):
        assert _generate(path, backend, [params] * 2, prompts) == want, backend


@settings(max_examples=120, deadline=None, database=None)
@given(masks=st.lists(st.binary(max_size=20), min_size=1, max_size=5), vocab=st.integers(1, 150),
       form=st.sampled_from(["bytes", "block", "block reversed", "read-only block", "span", "span in tensor",
                             "span out of order"]),
       skip=st.integers(0, 2), extra=st.integers(0, 2))
def test_masks_unpack_on_the_device_as_the_reference_unpacks_them(masks, vocab, form, skip, extra) -> None:
    """``allowed_on_device`` is ``allowed_tokens`` per row, for masks shorter than, exactly as long as, or longer
    than the vocabulary's bytes (incl. empty ones), as bytes or as slices of one buffer, in order or not, writable
    or not; and for masks of exactly the vocabulary's bytes that are consecutive rows of one batched mask call
    (``span``: ``skip`` rows before them, ``extra`` after; in a ``bytearray`` or in memory a tensor owns, as a
    backend's ``mask_memory`` gives it), which ``mask_rows_span`` finds and which then go as one copy."""
    from gemmaserve.sampling_params import allowed_tokens
    from gemmaserve.structured.grammar import mask_rows, mask_rows_span
    from gemmaserve.torch_sampling import allowed_on_device

    vocab_bytes = -(-vocab // 8)
    if form.startswith("span"):  # a tick's constrained rows: a run of one batch's rows, each the vocabulary's width
        rows = [mask[:vocab_bytes].ljust(vocab_bytes, b"\0") for mask in masks]
        total = skip + len(rows) + extra
        owner = torch.full((total * vocab_bytes,), 0x5A, dtype=torch.uint8) if form == "span in tensor" else None
        memory = None if owner is None else (lambda nbytes: (owner.data_ptr(), owner))
        views = mask_rows(total, vocab_bytes, memory)
        for i, row in enumerate(rows):
            views[skip + i][:] = row
        masks = views[skip:skip + len(rows)]
        expected = (views[0].obj, skip * vocab_bytes)
        assert views[0].obj.owner is (owner if owner is not None else views[0].obj.owner)
        if form == "span out of order" and len(masks) > 1:
            masks.reverse()
            rows.reverse()
            expected = None
        assert mask_rows_span(masks, vocab_bytes) == expected
        assert [bytes(mask) for mask in masks] == rows
        assert mask_rows_span(masks, vocab_bytes + 1) is None  # another vocabulary's width
    else:  # equal-width rows of one buffer made elsewhere: never taken for a batch's span
        if form != "bytes":
            width = max(len(mask) for mask in masks)
            block = bytearray(b"".join(mask.ljust(width, b"\0") for mask in masks))
            view = memoryview(block) if form != "read-only block" else memoryview(block).toreadonly()
            masks = [view[i * width:(i + 1) * width] for i in range(len(masks))]
            if form == "block reversed":
                masks.reverse()
        assert mask_rows_span(masks, vocab_bytes) is None  # copied row by row
    got = allowed_on_device(masks, vocab, torch.device("cpu"))
    assert got.shape == (len(masks), vocab)
    assert got.tolist() == [allowed_tokens(mask, vocab) for mask in masks]
