"""allowed_token_ids and a triggered (strict-tools) constraint on CUDA: custom-cuda, a tiny random Gemma 4 with the
tool tokens, bf16. Prints "ok" or "FAILED" per check. Run: PYTHONPATH=core:plugins/custom_torch:tests python
benchmarks/gpu_mask_check.py"""
import tempfile
from pathlib import Path

from gemmaserve import LLM, SamplingParams
from gemmaserve.structured import StructuredOutputs
from tiny_checkpoints import GEMMA4_TOOL_TOKENS, build_tiny_gemma4, save_tiny_tokenizer


def main() -> None:
    path = build_tiny_gemma4(Path(tempfile.mkdtemp()) / "ckpt")
    save_tiny_tokenizer(path, GEMMA4_TOOL_TOKENS)
    llm = LLM(str(path), backend="custom-cuda", device="cuda", dtype="bfloat16", max_batch_size=8)
    allowed = [9, 40, 41, 300]
    params = [SamplingParams(max_tokens=24, temperature=t, seed=s, ignore_eos=True, allowed_token_ids=allowed)
              for t, s in ((0.0, 1), (1.0, 2), (1.3, 3))] + [SamplingParams(max_tokens=24, temperature=1.0, seed=4,
                                                                              ignore_eos=True)]
    outs = llm.generate([[5, 6, 7]] * 4, params)
    bad = [o.token_ids for o in outs[:3] if not set(o.token_ids) <= set(allowed)]
    print("allowed_token_ids:", "ok" if not bad else f"FAILED {bad}", [len(o.token_ids) for o in outs])
    opener = llm.tokenizer.encode("<|tool_call>", add_special_tokens=False)[0]
    grammar = 'start: <|tool_call> "call:f{a:" /[0-9]{1,3}/ "}" <tool_call|>'
    spec = StructuredOutputs(grammar=grammar, trigger="<|tool_call>")
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True, logit_bias={opener: 100.0},
                        structured_outputs=spec, skip_special_tokens=False)
    out = llm.generate([[5, 6, 7]] * 3, [sp] * 3)
    texts = [o.text for o in out]
    ok = all(text.count("<|tool_call>") >= 2 and "call:f{a:" in text and o.finish_reason == "length"
             for text, o in zip(texts, out))
    print("triggered:", "ok" if ok else "FAILED", repr(texts[0][:160]))
    llm.close()


if __name__ == "__main__":
    main()
