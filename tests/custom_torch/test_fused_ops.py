"""The fused elementwise Triton kernels (kernels/fused_ops.py) against the eager op chains they replace, and a
whole model switched to them against the eager model, on CPU under ``TRITON_INTERPRET=1`` (fp32 and fp16,
tiny shapes; the interpreter is wrong for bf16). Runs in a subprocess: the interpreter flag must be set
before triton is imported. The bf16 GPU runs are in test_cuda_parity.py / test_cuda_graphs.py."""

from __future__ import annotations

import pytest

from triton_interpret import run_interpreted

pytest.importorskip("triton")

_KERNELS_SCRIPT = r"""
import json, torch
from gemmaserve_custom_torch.kernels.fused_ops import gelu_mul, norm_rope, ple_inputs, qkv_norm_rope, residual_norm
from gemmaserve_custom_torch.kernels.fused_ops import rope_tables
from gemmaserve_custom_torch.models.config import RopeParams
from gemmaserve_custom_torch.models.layers import RMSNorm, RotaryEmbedding, apply_rotary, gelu_tanh
torch.manual_seed(0)
errors = {}
def note(name, got, want):
    assert got.shape == want.shape and got.is_contiguous() and got.dtype == want.dtype, (name, got.shape, want.shape)
    errors[name] = max(errors.get(name, 0.0), float((got.float() - want.float()).abs().max()) if want.numel() else 0.0)
for dtype in (torch.float32, torch.float16):
    for style in ("w", "one_plus_w"):
        for dim, heads in ((16, 2), (32, 3), (24, 1)):
            norm = RMSNorm(dim, 1e-6, style, dtype=dtype)
            norm.weight.data = torch.randn(dim).to(dtype)
            rope = RotaryEmbedding(RopeParams(rope_type="proportional", theta=10000.0, partial_rotary_factor=0.5), dim)
            positions = torch.tensor([[0, 5, 9], [3, 4, 100]])
            cos, sin = rope(positions, dtype)
            wide = torch.randn(2, 3, heads * dim + dim + 5).to(dtype)  # q heads sliced out of a fused qkv output
            for x in (torch.randn(2, 3, heads, dim).to(dtype), wide[..., 5 : 5 + heads * dim].view(2, 3, heads, dim)):
                note(f"norm_rope/{dtype}", norm_rope(x, norm.weight, norm.eps, style, cos, sin),
                     apply_rotary(norm(x), cos, sin))
            q_norm, k_norm = norm, RMSNorm(dim, 1e-6, style, dtype=dtype)
            k_norm.weight.data = torch.randn(dim).to(dtype)
            v_norm = RMSNorm(dim, 1e-6, style, with_weight=False)
            for q_heads, kv_heads, k_eq_v, with_v_norm in ((heads, 1, False, True), (2 * heads, 2, True, True),
                                                            (heads, 1, False, False)):
                parts = q_heads + kv_heads * (1 if k_eq_v else 2)
                qkv = torch.randn(2, 3, parts * dim + 3).to(dtype)[..., 3:]  # rows strided as a sliced output
                q, k, v = qkv_norm_rope(qkv, q_heads, kv_heads, q_norm.weight, k_norm.weight, 1e-6, style, cos, sin,
                                        v_norm=with_v_norm, k_eq_v=k_eq_v)
                q_raw = qkv[..., : q_heads * dim].view(2, 3, q_heads, dim)
                k_raw = qkv[..., q_heads * dim : (q_heads + kv_heads) * dim].view(2, 3, kv_heads, dim)
                v_raw = k_raw if k_eq_v else qkv[..., (q_heads + kv_heads) * dim :].view(2, 3, kv_heads, dim)
                note(f"qkv_norm_rope.q/{dtype}", q, apply_rotary(q_norm(q_raw), cos, sin))
                note(f"qkv_norm_rope.k/{dtype}", k, apply_rotary(k_norm(k_raw), cos, sin))
                if with_v_norm:
                    note(f"qkv_norm_rope.v/{dtype}", v, v_norm(v_raw))
                else:
                    assert torch.equal(v, v_raw)
                # prompt-sized launches take several tokens a program: 4 of the 6 (a partial last block), all 8 (the
                # same bits under the interpreter; on a GPU the reduction layout may move last bits)
                for rows in (4, 8):
                    got = qkv_norm_rope(qkv, q_heads, kv_heads, q_norm.weight, k_norm.weight, 1e-6, style, cos, sin,
                                        v_norm=with_v_norm, k_eq_v=k_eq_v, rows_per_program=rows)
                    assert all(torch.equal(a, b) for a, b in zip(got, (q, k, v))), rows
                # the K/V written to cache rows (a decode step's KV write in the same launch): the same bits
                k_cache, v_cache = torch.zeros(20, kv_heads, dim).to(dtype), torch.zeros(20, kv_heads, dim).to(dtype)
                slots = torch.tensor([7, 3, 19, 0, 12, 5])
                none_q, none_k, none_v = qkv_norm_rope(qkv, q_heads, kv_heads, q_norm.weight, k_norm.weight, 1e-6,
                                                       style, cos, sin, v_norm=with_v_norm, k_eq_v=k_eq_v,
                                                       cache=(k_cache, v_cache, slots))
                assert none_k is None and none_v is None and torch.equal(none_q, q)
                assert torch.equal(k_cache[slots], k.reshape(6, kv_heads, dim))
                assert torch.equal(v_cache[slots], v.reshape(6, kv_heads, dim))
                untouched = [row for row in range(20) if row not in slots.tolist()]
                assert not k_cache[untouched].any() and not v_cache[untouched].any()
                k_rows, v_rows = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
                rows_q, _, _ = qkv_norm_rope(qkv, q_heads, kv_heads, q_norm.weight, k_norm.weight, 1e-6, style, cos,
                                             sin, v_norm=with_v_norm, k_eq_v=k_eq_v, cache=(k_rows, v_rows, slots),
                                             rows_per_program=4)
                assert torch.equal(rows_q, q) and torch.equal(k_rows, k_cache) and torch.equal(v_rows, v_cache)
        for hidden in (16, 40):
            post, nxt = RMSNorm(hidden, 1e-6, style, dtype=dtype), RMSNorm(hidden, 1e-5, style, dtype=dtype)
            post.weight.data, nxt.weight.data = torch.randn(hidden).to(dtype), torch.randn(hidden).to(dtype)
            residual, h = torch.randn(2, 3, hidden).to(dtype), torch.randn(2, 3, hidden).to(dtype)
            scale = torch.tensor([0.75]).to(dtype)
            y, z = residual_norm(residual, h, post.weight, post.eps, style, next_weight=nxt.weight, next_eps=nxt.eps)
            note(f"residual_norm/{dtype}", y, residual + post(h))
            note(f"residual_norm.next/{dtype}", z, nxt(residual + post(h)))
            y, none = residual_norm(residual, h, post.weight, post.eps, style, scale=scale)
            assert none is None
            note(f"residual_norm.scale/{dtype}", y, (residual + post(h)) * scale)
    for rope_params, dim in ((RopeParams(rope_type="proportional", theta=1e6, partial_rotary_factor=0.25), 32),
                             (RopeParams(rope_type="default", theta=10000.0), 24)):
        rope = RotaryEmbedding(rope_params, dim)  # the eager tables (the kernel unset here)
        positions = torch.tensor([[0, 1, 7, 4095], [131071, 100000, 3, 2]])
        got_cos, got_sin = rope_tables(positions, rope.inv_freq(positions.device), dtype)
        want_cos, want_sin = rope(positions, dtype)
        note(f"rope_tables.cos/{dtype}", got_cos, want_cos)
        note(f"rope_tables.sin/{dtype}", got_sin, want_sin)
    for layers, dim in ((3, 16), (2, 24)):  # Gemma 4's per-layer inputs after their projection
        norm = RMSNorm(dim, 1e-6, "w", dtype=dtype)
        norm.weight.data = torch.randn(dim).to(dtype)
        projection = (torch.randn(2, 3, layers * dim) * 4).to(dtype)
        token_part = torch.randn(2, 3, layers, dim).to(dtype)
        want = (norm((projection * 1536 ** -0.5).reshape(2, 3, layers, dim)) + token_part) * 2.0 ** -0.5
        got = ple_inputs(projection, token_part, norm.weight, 1e-6, "w", 1536 ** -0.5, 2.0 ** -0.5)
        note(f"ple_inputs/{dtype}", got, want)
        for rows in (4, 8):  # several rows a program (a partial last block): the same bits under the interpreter
            assert torch.equal(ple_inputs(projection, token_part, norm.weight, 1e-6, "w", 1536 ** -0.5, 2.0 ** -0.5,
                                          rows_per_program=rows), got), rows
        # the token part looked up in the kernel: ScaledEmbedding's table[ids] * scale, rounded to the dtype
        table, ids = torch.randn(11, layers * dim).to(dtype), torch.tensor([[3, 0, 10], [7, 7, 1]])
        scale = torch.tensor(dim ** 0.5, dtype=torch.float64).to(dtype)
        looked_up = (torch.nn.functional.embedding(ids, table) * scale).reshape(2, 3, layers, dim)
        expected = ple_inputs(projection, looked_up, norm.weight, 1e-6, "w", 1536 ** -0.5, 2.0 ** -0.5)
        for rows in (None, 4):
            assert torch.equal(ple_inputs(projection, None, norm.weight, 1e-6, "w", 1536 ** -0.5, 2.0 ** -0.5,
                                          lookup=(ids, table, scale), rows_per_program=rows), expected), rows
    for width in (7, 16, 1500):
        both = (torch.randn(3, 2 * width) * 3).to(dtype)
        a, b = both.chunk(2, dim=-1)  # the halves of a fused gate/up output: strided rows
        note(f"gelu_mul/{dtype}", gelu_mul(a, b), gelu_tanh(a) * b)
try:
    norm_rope(torch.randn(1, 1, 1, 5), None, 1e-6, "w", torch.randn(1, 1, 5), torch.randn(1, 1, 5))
    raise SystemExit("odd head dim accepted")
except ValueError:
    pass
print(json.dumps(errors))
"""

_MODEL_SCRIPT = r"""
import json, sys, torch
from gemmaserve_custom_torch.models import ContiguousKVContext, GemmaForCausalLM
from gemmaserve_custom_torch.models.fusion import fuse_elementwise, fuse_projections
path = sys.argv[1]
torch.set_num_threads(1)
plain = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
fused = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
fuse_projections(fused)
switched = fuse_elementwise(fused)
out = {"switched": switched, "layers": len(fused.layers)}
# the fused layers carry each next input norm (and the final norm) in their last kernel: only layer 0's runs alone;
# no v norm runs alone either
separate_norms = []
for i, layer in enumerate(fused.layers):
    layer.input_layernorm.register_forward_pre_hook(lambda module, args, i=i: separate_norms.append(i))
    if layer.self_attn.v_norm is not None:  # a KV-storing layer's v norm runs in its q/k/v kernel
        layer.self_attn.v_norm.register_forward_pre_hook(lambda module, args, i=i: separate_norms.append(f"v{i}"))
fused.norm.register_forward_pre_hook(lambda module, args: separate_norms.append("final"))
if hasattr(fused, "per_layer_projection_norm"):  # Gemma 4's per-layer inputs: one kernel after their projection
    fused.per_layer_projection_norm.register_forward_pre_hook(lambda module, args: separate_norms.append("ple"))
prompt = torch.tensor([[(7 * i + 3) % 200 + 4 for i in range(13)]])
with torch.inference_mode():
    logits = []
    for model in (plain, fused):
        ctx = ContiguousKVContext(model.config)
        logits.append(model(prompt, ctx.next_positions(1, 13), ctx))
    out["max_logit_diff"] = float((logits[0] - logits[1]).abs().max())
    out["argmax_equal"] = bool(torch.equal(logits[0].argmax(-1), logits[1].argmax(-1)))
    tokens = []
    for model in (plain, fused):
        ctx, ids, got = ContiguousKVContext(model.config), prompt, []
        for _ in range(6):
            step = model(ids, ctx.next_positions(1, ids.shape[1]), ctx, logits_to_keep=1)
            got.append(int(step[0, -1].argmax()))
            ids = torch.tensor([[got[-1]]])
        tokens.append(got)
    out["tokens_equal"] = tokens[0] == tokens[1]
out["separate_norms"] = sorted(set(map(str, separate_norms)))
print(json.dumps(out))
"""


def test_fused_kernels_match_the_eager_chains_under_interpreter():
    errors = run_interpreted(_KERNELS_SCRIPT)
    assert len(errors) == 22, errors  # 11 checks x 2 dtypes ran
    for name, error in errors.items():
        # fp32: the kernels differ only in summation order / rsqrt / the tanh formula; fp16: at most about one
        # rounding step of the outputs (values up to ~10)
        assert error < (1e-5 if "float32" in name else 1.6e-2), (name, error)


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_moe"])
def test_a_model_on_the_fused_kernels_keeps_its_logits_and_tokens(tiny_checkpoint, name):
    result = run_interpreted(_MODEL_SCRIPT, str(tiny_checkpoint(name)))
    assert result["switched"] == result["layers"]  # MoE layers too (their router / experts stay eager here)
    assert result["max_logit_diff"] < 1e-4, result
    assert result["argmax_equal"] and result["tokens_equal"], result
    assert result["separate_norms"] == ["0"], result


_NARROWED_SCRIPT = r"""
import json, sys, torch
sys.path[:0] = [sys.argv[2]]  # tests/custom_torch: fixtures_backend
from fixtures_backend import make_backend
from gemmaserve_custom_torch.models.fusion import fuse_elementwise, fuse_projections
torch.set_num_threads(1)
path = sys.argv[1]
prompts = [[(3 * i + j) % 300 + 4 for i in range(n)] for j, n in enumerate([5, 8, 1, 7])]

def one_tick(backend):
    with backend.lock:
        decoding = backend.prefill([9, 10, 11, 12, 13])
        batch = backend.splice_into_batched(None, decoding.kv, backend.kv_length(decoding.kv))
        states = [backend.prefill_lookup(p) for p in prompts]
        out = backend.forward_step(states, [len(p) for p in prompts], batch, [7])
    assert out.prefill_errors == [None] * len(prompts)
    return [out.decode_logits.clone()] + [state.last_logits.clone() for state in states]

plain = make_backend(path, fast_prefill=True)
assert plain.mixed.narrow_layer is not None
want = one_tick(plain)
fuse_projections(plain.model)  # the fixture's model is shared: the next backend runs it fused
fuse_elementwise(plain.model)
got = one_tick(make_backend(path, fast_prefill=True))
print(json.dumps({"max_diff": max(float((a - b).abs().max()) for a, b in zip(got, want)),
                  "argmax_equal": all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, want))}))
"""


def test_fused_layers_carry_their_norms_through_the_narrowed_prefill(tiny_checkpoint):
    """Fast prefill narrows the KV-shared tail to the kept positions mid-forward: the norm a fused layer carries
    to the next one is narrowed with the hidden states (logits of a mixed tick as the unfused model's)."""
    from pathlib import Path

    result = run_interpreted(_NARROWED_SCRIPT, str(tiny_checkpoint("gemma4")), str(Path(__file__).parent))
    assert result["max_diff"] < 1e-4 and result["argmax_equal"], result


_DECODE_SCRIPT = r"""
import json, sys, torch
sys.path[:0] = [sys.argv[2]]  # tests/custom_torch: fixtures_backend
from fixtures_backend import make_backend
from gemmaserve_custom_torch.kv.decode_context import DecodeBatchContext
from gemmaserve_custom_torch.kv.forward_batch import RaggedPagedContext
from gemmaserve_custom_torch.models.fusion import fuse_elementwise, fuse_projections
torch.set_num_threads(1)
path = sys.argv[1]
targets, prompt_targets = [], []

def recording(context, into):  # the layers whose K/V the fused kernel wrote through the context's target
    take = context.kv_cache_target
    def target(self, layer):
        got = take(self, layer)
        if got is not None:
            into.append(layer)
        return got
    context.kv_cache_target = target

recording(DecodeBatchContext, targets)
recording(RaggedPagedContext, prompt_targets)

def decode(backend):
    with backend.lock:
        batch, ids = None, []
        steps = []
        for prompt in ([5, 6, 7, 8, 9], [10, 11, 12]):
            state = backend.prefill(prompt)
            batch = backend.splice_into_batched(batch, state.kv, backend.kv_length(state.kv))
            ids.append(int(state.last_logits.argmax()))
            steps.append(state.last_logits.reshape(1, -1).expand(2, -1))
        for _ in range(4):
            logits = backend.decode_step_batched(batch, ids).clone()
            steps.append(logits)
            ids = logits.argmax(-1).tolist()
    return torch.stack(steps)

plain = make_backend(path)
want = decode(plain)
assert not targets and not prompt_targets
fuse_projections(plain.model)  # the fixture's model is shared: the next backend runs it fused
fuse_elementwise(plain.model)
got = decode(make_backend(path))
storing = [i for i in range(len(plain.model.layers)) if plain.model.config.stores_kv(i)]
print(json.dumps({"max_diff": float((got - want).abs().max()),
                  "argmax_equal": torch.equal(got.argmax(-1), want.argmax(-1)), "targets": sorted(set(targets)),
                  "prompt_targets": sorted(set(prompt_targets)), "storing": storing}))
"""


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_k_eq_v"])
def test_the_fused_qkv_kernel_writes_the_prompt_and_decode_kv(tiny_checkpoint, name):
    """Prompt ticks and decode-only ticks of a fused model: every KV-storing layer's q/k/v kernel writes its K/V
    into the pools (RaggedPagedContext / DecodeBatchContext.kv_cache_target, no separate scatter), and the
    prompts' last logits and the decode steps' logits, which read that K/V, are the unfused model's (fp32, up to
    summation order): Gemma 4 (v normed), Gemma 3 (v copied), K=V layers."""
    from pathlib import Path

    result = run_interpreted(_DECODE_SCRIPT, str(tiny_checkpoint(name)), str(Path(__file__).parent))
    assert result["targets"] == result["storing"] == result["prompt_targets"], result
    assert result["max_diff"] < 1e-4 and result["argmax_equal"], result
