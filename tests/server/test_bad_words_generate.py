"""``bad_words`` against transformers' ``generate(bad_words_ids=...)``: on a tiny random Gemma 4 (fp32, CPU,
greedy), custom-cpu and hf give transformers' tokens for the same token sequences (each word as is and with a
leading space). transformers also matches a sequence across the prompt's end, vLLM and gemmaserve within the
output only, so the words are chosen so that no sequence's prefix ends the prompt."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")


def test_bad_words_give_transformers_tokens(chat_checkpoint) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(chat_checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(chat_checkpoint), dtype=torch.float32).eval()
    prompt = tokenizer.encode("the bad words test", add_special_tokens=True)
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[], pad_token_id=0, max_new_tokens=24, do_sample=False)

    def hf_generate(bad: list[list[int]] | None) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), generation_config=config, bad_words_ids=bad)
        return out[0, len(prompt):].tolist()

    free = hf_generate(None)
    words, sequences = [], []
    for token in dict.fromkeys(free[2:14:3]):  # words the free run would write
        word = tokenizer.decode([token]).strip()
        if not word:
            continue
        seqs = [tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]
        if any(len(s) > 1 and s[0] == prompt[-1] for s in seqs) or not all(seqs):
            continue
        words.append(word)
        sequences += [s for s in seqs if s not in sequences]
    assert words, free
    expected = hf_generate(sequences)
    assert expected != free
    for backend in ("custom-cpu", "hf"):
        llm = LLM(str(chat_checkpoint), backend=backend, device="cpu", dtype="float32", max_batch_size=2)
        try:
            got = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, bad_words=words))[0]
        finally:
            llm.close()
        assert got.token_ids == expected, backend
