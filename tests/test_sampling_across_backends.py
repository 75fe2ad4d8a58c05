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

from gemmaserve.engine.sampling_cpu import sample_row  # noqa: E402
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
    backends = ["custom-cpu", "hf"]
    if _mlx_sample() is not None:
        backends.append("mlx")
    runs = {name: _generate(path, name, params, prompts) for name in backends}
    for name in backends[1:]:
        assert runs[name] == runs["custom-cpu"], name
