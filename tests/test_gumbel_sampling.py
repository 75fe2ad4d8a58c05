"""The seeded draw is the Gumbel-max trick (``gemmaserve.engine.sampling_cpu``'s docstring): every token gets
its own noise of (seed, step, id), the pick is the kept token with the largest ``logit / T + noise``. The torch
and mlx noise are the definition's bit for bit, the samplers pick the definition's token, the draws follow the
kept softmax, and logits that differ by float rounding (a row batched with others vs alone) keep the token."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from gemmaserve.engine import sampling_cpu  # noqa: E402
from gemmaserve.engine.sampling_cpu import _filtered_probs, sample_rows, sampling_seed  # noqa: E402
from gemmaserve.sampling_params import RowSampling  # noqa: E402
from gemmaserve.torch_sampling import _signed64, gumbel_noise, noise_bits, sample_tokens  # noqa: E402


def _mlx():
    try:
        import mlx.core as mx
        from gemmaserve_mlx import sampling as mlx_sampling
    except ImportError:
        return None
    return mx, mlx_sampling


def _pack(allowed: set[int], nbytes: int) -> bytes:
    mask = bytearray(nbytes)
    for token in allowed:
        mask[token >> 3] |= 1 << (token & 7)
    return bytes(mask)


def test_torch_and_mlx_noise_are_the_definitions_bit_for_bit() -> None:
    """The 53-bit integers behind u_i, for keys on both sides of 2**63 and ids up to 262,143 (int64 torch
    arithmetic that wraps, numpy uint64), and the float64 noise itself."""
    rng = random.Random(17)
    keys = [0, 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1, sampling_seed(0, 0), sampling_seed(2**63 - 1, 500)]
    keys += [rng.getrandbits(64) for _ in range(8)] + [rng.randrange(2**63, 2**64) for _ in range(8)]
    vocab = 262_144
    ids = sorted({0, 1, 2, 255, 4095, 65_535, 131_071, 262_142, 262_143} | {rng.randrange(vocab) for _ in range(40)})
    bits = noise_bits(torch.tensor([[_signed64(key)] for key in keys]), vocab)
    noise = gumbel_noise(torch.tensor([[_signed64(key)] for key in keys]), vocab)
    assert bits.dtype == torch.int64 and noise.dtype == torch.float64 and bits.shape == (len(keys), vocab)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**53
    for r, key in enumerate(keys):
        got = bits[r, ids].tolist()
        assert got == [sampling_cpu.noise_bits(key, i) for i in ids], key
        want = [sampling_cpu.gumbel_noise(key, i) for i in ids]
        assert noise[r, ids].tolist() == pytest.approx(want, rel=1e-15, abs=1e-15)
    mlx = _mlx()
    if mlx is not None:
        _, mlx_sampling = mlx
        assert mlx_sampling.noise_bits(keys, vocab)[:, ids].tolist() == bits[:, ids].tolist()
        got = mlx_sampling.gumbel_noise(keys, vocab)[:, ids].ravel().tolist()
        assert got == pytest.approx(noise[:, ids].ravel().tolist(), rel=1e-15, abs=1e-15)


def test_the_noise_is_uniform_enough() -> None:
    """u_i over many ids and keys: mean 1/2, no obvious bias in the low or high bits."""
    bits = noise_bits(torch.tensor([[_signed64(sampling_seed(s, 3))] for s in range(8)]), 65_536)
    u = (bits.to(torch.float64) + 0.5) * 2.0**-53
    assert abs(u.mean().item() - 0.5) < 0.002
    assert abs((bits & 1).to(torch.float64).mean().item() - 0.5) < 0.002
    assert abs((u < 0.01).to(torch.float64).mean().item() - 0.01) < 0.001


_row = st.tuples(
    st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7]),  # temperature (0: greedy, mixed into the same batch)
    st.sampled_from([1.0, 1.0, 0.95, 0.5, 1e-9]),  # top_p
    st.sampled_from([0, 0, 1, 5, 40]),  # top_k
    st.sampled_from([0.0, 0.0, 0.05, 0.3]),  # min_p
    st.integers(0, 2**63 - 1),  # seed
    st.integers(0, 500),  # step
    st.sampled_from(["none", "none", "banned", "allowed"]),
)


def _rows(specs, vocab: int) -> list[RowSampling]:
    rows = []
    for t, p, k, min_p, seed, step, extra in specs:
        banned = (0, 3, 7, vocab - 1) if extra == "banned" else ()
        allowed = _pack(set(range(1, vocab, 4)) | {2}, -(-vocab // 8)) if extra == "allowed" else None
        rows.append(RowSampling(t, p, k, seed, step, min_p, banned=banned, allowed=allowed))
    return rows


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(_row, min_size=1, max_size=6), data_seed=st.integers(0, 2**31),
       dtype=st.sampled_from(["float32", "float64", "bfloat16"]), vocab=st.sampled_from([2, 13, 97, 300]),
       scale=st.sampled_from([0.25, 3.0]))
def test_torch_and_mlx_pick_the_definitions_token(specs, data_seed, dtype, vocab, scale) -> None:
    """Float32 / float64 / bfloat16 logits (bfloat16 at scale 0.25: many exact ties), with and without
    top-k / top-p / min-p (without any on every row: the sort-free path), bans, allowed masks and greedy rows
    in the same batch: torch picks ``sample_rows``' token; mlx too (float32 logits)."""
    generator = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(specs), vocab, generator=generator, dtype=torch.float64) * scale
    logits = logits.to(getattr(torch, dtype))
    rows = _rows(specs, vocab)
    expected, _ = sample_rows([[float(x) for x in line] for line in logits], rows)
    assert sample_tokens(logits, rows).token_ids == expected
    mlx = _mlx()
    if mlx is not None and dtype == "float32":
        mx, mlx_sampling = mlx
        # float32 scores in mlx against float64: parts only if the top two are within ~1e-6 (never here)
        assert mlx_sampling.sample_tokens(mx.array(logits.numpy()), rows).tolist() == expected


def test_the_sort_free_path_and_the_sorted_path_agree() -> None:
    """A min_p so small that it keeps every finite token sends a row through the sort (the filtered path)
    without changing its kept set: same tokens as the sort-free path, ties included (bfloat16 logits)."""
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(64, 1000, generator=generator) * 0.5).to(torch.bfloat16)
    logits[5, :] = logits[5, 0]  # a row of exact ties
    logits[9, 10:] = float("-inf")  # only ten finite tokens
    plain = [RowSampling(0.7 + 0.01 * i, 1.0, 0, 100 + i, i) for i in range(64)]
    tiny_min_p = [RowSampling(r.temperature, 1.0, 0, r.seed, r.step, 1e-300) for r in plain]
    assert sample_tokens(logits, plain).token_ids == sample_tokens(logits, tiny_min_p).token_ids
    assert sample_tokens(logits, plain).token_ids[9] < 10


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("row", [
    RowSampling(1.0, 1.0, 0, 0, 0),
    RowSampling(0.6, 1.0, 0, 0, 0),
    RowSampling(1.3, 1.0, 4, 0, 0),
    RowSampling(1.0, 0.8, 0, 0, 0),
    RowSampling(1.0, 1.0, 0, 0, 0, 0.2),
], ids=["plain", "temperature", "top_k", "top_p", "min_p"])
def test_draws_follow_the_kept_softmax(row) -> None:
    """Over 6,000 (seed, step) pairs the token frequencies match the kept, renormalised softmax (chi-square
    well under a bound the fixed seeds can never flake past); the pure-Python definition draws the same
    tokens as torch."""
    logits = [2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, -40.0]
    rows = [RowSampling(row.temperature, row.top_p, row.top_k, seed, seed % 7, row.min_p) for seed in range(6000)]
    tokens = sample_tokens(torch.tensor([logits] * len(rows), dtype=torch.float32), rows).token_ids
    assert tokens[:500] == sample_rows([logits] * 500, rows[:500])[0]
    kept = _filtered_probs(logits, row)
    ids, probs = [t for t, p in kept if p > 1e-4], [p for _, p in kept if p > 1e-4]
    assert set(tokens) <= {t for t, _ in kept}
    counts = [tokens.count(t) for t in ids]
    assert sum(counts) >= len(tokens) - 5
    assert _chi_square(counts, [p / sum(probs) for p in probs]) < 30.0 + 3 * len(ids), (counts, probs)


def test_seeded_tokens_survive_batching_rounding() -> None:
    """Batched and solo logits of a row differ by float rounding (~1e-6 relative): simulated on 262,144-token
    rows (normal, wider normal, heavy-tailed), 120 (seed, step) pairs x 3 rows at temperature 1, the sampled
    token never changes (a change needs the top two perturbed scores within ~1e-6 of each other: about 1e-6
    to 1e-4 per draw for these rows). The inverse-CDF draw this replaced changes 12 of these 360 draws (9, 3
    and 0 per row)."""
    generator = torch.Generator().manual_seed(1234)
    vocab = 262_144
    logits = torch.stack([torch.randn(vocab, generator=generator), torch.randn(vocab, generator=generator) * 3,
                          2 * torch.randn(vocab, generator=generator)
                          / torch.randn(vocab, generator=generator).abs().clamp(min=0.05)])
    perturbed = logits * (1 + 1e-6 * torch.randn(logits.shape, generator=generator))
    assert (perturbed != logits).float().mean().item() > 0.9
    flips = 0
    for pair in range(120):
        rows = [RowSampling(1.0, 1.0, 0, 1000 + pair, pair % 17)] * 3
        both = sample_tokens(torch.cat([logits, perturbed]), rows + rows).token_ids
        flips += sum(a != b for a, b in zip(both[:3], both[3:]))
    assert flips == 0


def test_tiny_vocabulary_edge_cases() -> None:
    """All -inf but one, a single token, and a row of all -inf (token 0, as the definition keeps)."""
    inf = math.inf
    cases = [([-inf, -inf, 1.0, -inf], 2), ([3.0], 0), ([-inf, -inf, -inf], 0)]
    for logits, want in cases:
        row = RowSampling(1.0, 1.0, 0, 5, 1)
        assert sample_rows([logits], [row])[0] == [want]
        assert sample_tokens(torch.tensor([logits]), [row]).token_ids == [want]
        filtered = RowSampling(1.0, 0.9, 2, 5, 1, 0.1)
        assert sample_rows([logits], [filtered])[0] == [want]
        assert sample_tokens(torch.tensor([logits]), [filtered]).token_ids == [want]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_is_the_cpu_one_without_a_host_sync() -> None:
    """On CUDA the int64 noise is the CPU's bit for bit and the tokens are the CPU sampler's (262,144-token
    bfloat16 and float32 rows, plain and filtered, greedy mixed in); ``sample_on_device`` never syncs."""
    from gemmaserve.torch_sampling import sample_on_device

    keys = torch.tensor([[_signed64(sampling_seed(s, 7))] for s in range(4)] + [[_signed64(2**64 - 1)]])
    assert torch.equal(noise_bits(keys.cuda(), 262_144).cpu(), noise_bits(keys, 262_144))
    generator = torch.Generator().manual_seed(8)
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(16, 262_144, generator=generator) * 2).to(dtype)
        for filters in ((1.0, 0, 0.0), (0.9, 0, 0.0), (1.0, 40, 0.0), (0.95, 0, 0.05)):
            rows = [RowSampling(0.0 if i % 5 == 4 else 0.6 + 0.1 * i, filters[0], filters[1], 50 + i, i,
                                filters[2], banned=(i,)) for i in range(16)]
            want = sample_tokens(logits, rows).token_ids
            on_device = logits.cuda()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                tokens, _ = sample_on_device(on_device, rows)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert tokens.tolist() == want, (dtype, filters)
