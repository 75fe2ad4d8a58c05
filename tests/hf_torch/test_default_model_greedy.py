"""``make run``'s CPU configuration on the default model (issue 16 item 7): ``BACKEND=auto`` / ``DTYPE=auto`` on the
CPU pick the backend and dtype that ``benchmarks/cpu_default.py`` measured fastest (hf; bfloat16 where the CPU has
bfloat16 matmul instructions, else float32), and the greedy text through the engine is transformers' own
``generate`` in that dtype, token for token. Skips when the default model is not converted yet."""

from __future__ import annotations

import pytest

from gemmaserve.hardware import cpu_has_native_bfloat16
from gemmaserve.models import default_model as dm

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

needs_default_model = pytest.mark.skipif(not dm.is_default_model_ready(),
                                         reason="the default model is not converted (run `make run` once)")

PROMPTS = ("The capital of France is", "def fibonacci(n):")
TOKENS = 32  # the 270M model's step costs ~0.1 s on a 2-core CI box, twice (ours and transformers')


def _transformers_greedy(dtype: torch.dtype, int8: bool = False) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(dm.default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    if int8:
        from gemmaserve_hf_torch.int8 import quantize_linears

        quantize_linears(model)
    out: list[list[int]] = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=TOKENS,
                                       min_new_tokens=TOKENS, eos_token_id=None, pad_token_id=0)
            out.append(generated[0, ids.shape[1]:].tolist())
    return out


@needs_default_model
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_make_run_greedy_text_is_transformers_own_in_the_auto_dtype(dtype: str) -> None:
    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams

    llm = LLM(str(dm.default_model_dir()), backend="auto", device="cpu", dtype=dtype, max_batch_size=1)
    try:
        assert type(llm.engine.backend).__name__ == "HFTorchBackend"  # the faster CPU backend (docs/benchmarks.md)
        resolved = llm.engine.backend.model_info.dtype
        expected = "bfloat16" if dtype == "bfloat16" or cpu_has_native_bfloat16() else "float32"
        assert resolved == expected
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        ours = [llm.generate([prompt], params)[0].token_ids for prompt in PROMPTS]
    finally:
        llm.close()
    theirs = _transformers_greedy(getattr(torch, resolved))
    for prompt, mine, reference in zip(PROMPTS, ours, theirs):
        assert list(mine) == reference, f"{resolved} greedy tokens differ from transformers' for {prompt!r}"


@needs_default_model
def test_the_demos_int8_greedy_text_is_transformers_own_on_the_quantized_model() -> None:
    """What `make run` runs on a CPU without bfloat16 matmuls (QUANTIZATION=int8, one prompt at a time): the
    greedy tokens of transformers' `generate` on the same int8 model."""
    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams
    from gemmaserve_hf_torch.int8 import int8_unavailable_reason

    if int8_unavailable_reason("cpu") is not None:
        pytest.skip(str(int8_unavailable_reason("cpu")))
    llm = LLM(str(dm.default_model_dir()), backend="auto", device="cpu", dtype="float32", quantization="int8",
              max_batch_size=1)
    try:
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        ours = [llm.generate([prompt], params)[0].token_ids for prompt in PROMPTS]
    finally:
        llm.close()
    for prompt, mine, reference in zip(PROMPTS, ours, _transformers_greedy(torch.float32, int8=True)):
        assert list(mine) == reference, f"int8 greedy tokens differ from transformers' for {prompt!r}"


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
def test_bfloat16_greedy_past_a_sliding_window_is_transformers_own(tmp_path, family: str) -> None:
    """In bfloat16 with transformers' sdpa attention, a decode past a sliding layer's window attends over the window's
    keys only, as ``generate``'s own sliding cache does: the hf backend kept every position and masked the old ones,
    and bf16 sdpa rounded that longer sum differently (first differences 5-18 tokens in, on windows of 8-11)."""
    from tiny_checkpoints import build_tiny_gemma3, build_tiny_gemma4
    from transformers import AutoModelForCausalLM

    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams

    path = tmp_path / family
    if family == "gemma4":
        build_tiny_gemma4(path)  # sliding_window 8
    else:
        build_tiny_gemma3(path, seed=402, num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
                          num_attention_heads=6, num_key_value_heads=6, head_dim=20, hidden_size=48,
                          intermediate_size=48, sliding_window=11, query_pre_attn_scalar=24,
                          final_logit_softcapping=None)
    prompts = [[115, 262, 75, 148, 75, 390, 52, 320, 413, 132, 469, 276, 365, 418, 312, 465, 79, 162, 54, 377],
               [436, 201, 392], [7, 300, 12, 99, 250, 31, 8, 160, 400, 2, 77, 19, 350, 61, 205, 140, 9, 480, 333]]
    tokens = 24
    llm = LLM(str(path), backend="hf", device="cpu", dtype="bfloat16", max_batch_size=1)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        ours = [list(llm.generate([{"prompt_token_ids": p}], params)[0].token_ids) for p in prompts]
    finally:
        llm.close()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        for prompt, mine in zip(prompts, ours):
            ids = torch.tensor([prompt])
            reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                                       min_new_tokens=tokens, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
            assert mine == reference.tolist(), prompt
