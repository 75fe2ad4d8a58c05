"""The real default model (Gemma 3 270M, converted from the PyPI GGUF) through the scheduler:
custom_torch and hf_torch greedy tokens equal transformers' ``generate`` on real prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gemmaserve_custom_torch")
pytest.importorskip("gemmaserve_hf_torch")

from gemmaserve import LLM, SamplingParams  # noqa: E402
from gemmaserve.models.default_model import ensure_default_model  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The capital of France is a city where",  # shares a prefix with the first prompt
)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    return ensure_default_model(progress=False)


def _reference_tokens(model_dir: Path, attn_implementation: str) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    ).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
            outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "attn_implementation"), [("custom-cpu", "eager"), ("hf", "sdpa")])
def test_greedy_tokens_equal_transformers_generate(real_model_dir: Path, backend: str, attn_implementation: str) -> None:
    expected = _reference_tokens(real_model_dir, attn_implementation)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=str(real_model_dir), backend=backend, device="cpu", dtype="float32") as llm:
        outputs = llm.generate(list(PROMPTS), params)
        again = llm.generate([PROMPTS[0]], params)[0]
    for prompt, out, want in zip(PROMPTS, outputs, expected):
        assert out.token_ids == want, f"{backend}: {prompt!r} -> {out.text!r}"
    # the repeated prompt comes from the prefix cache, with the same tokens
    assert again.cached_tokens > 0
    assert again.token_ids == expected[0]


def test_json_strict_tools_on_gemmas_vocabulary_leave_text_free(real_model_dir: Path) -> None:
    """On Gemma 3's 262,144 tokens: an end-of-turn first ends an empty reply; a shown tag token (``<b>``, which
    llguidance holds special while the tokenizer shows it as text) opens a free reply; a call opening is held to
    the strict schema and ends the reply when it closes."""
    pytest.importorskip("llguidance")
    from gemmaserve.hf_tokenizer import HFTokenizerAdapter
    from gemmaserve.structured import GrammarCompiler
    from gemmaserve.tools.constraints import strict_calls_constraint

    hf = transformers.AutoTokenizer.from_pretrained(real_model_dir)
    compiler = GrammarCompiler(HFTokenizerAdapter(hf), len(hf), [hf.eos_token_id])
    tools = [{"name": "weather", "strict": True, "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 8}}}}]
    spec = strict_calls_constraint(tools, "json")

    def walk(text_or_ids):
        constraint = compiler.compile(spec)
        ids = text_or_ids if isinstance(text_or_ids, list) else hf.encode(text_or_ids, add_special_tokens=False)
        for token in ids:
            mask = constraint.allowed()
            if not mask[token >> 3] >> (token & 7) & 1:
                return None
            constraint.accept(token)
        return constraint

    end_of_turn = hf.convert_tokens_to_ids("<end_of_turn>")
    assert walk([end_of_turn]).phase == "open"
    tagged = walk("<b>Note</b>: it rains")
    assert tagged is not None and tagged.phase == "free"
    from gemmaserve.sampling_params import all_tokens_mask

    assert bytes(tagged.allowed()) == all_tokens_mask(len(hf))  # every token, special ones included
    held = walk('{"name":"weather","arguments":{"city":"Oslo"}}')
    assert held is not None and held.is_complete
    assert walk('{"name":"weather","arguments":{"city":"Stockholm"}}') is None
