"""min_p, min_tokens, logit_bias and the penalties over HTTP reach the engine's sampling (never silently ignored): the
completions equal the offline reference for the same parameters."""

from __future__ import annotations

from typing import Any

from gemmaserve.sampling_params import SamplingParams

from server_harness import REFERENCE_MODEL as MODEL


def _complete(client: Any, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_sampling_fields_reach_the_sampler(ref: Any) -> None:
    client, engine = ref
    backend = engine.backend
    tokenizer = backend.tokenizer

    def expected(**params: Any) -> str:
        return tokenizer.decode(backend.reference_generate([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True,
                                                                                        **params)))

    forced = _complete(client, temperature=0.9, seed=3, logit_bias={"9": 100})
    assert forced["choices"][0]["text"] == tokenizer.decode([9] * 8)
    for fields in ({"temperature": 1.5, "seed": 4, "min_p": 0.3}, {"temperature": 0.0, "logit_bias": {"12": 6.5}},
                   {"temperature": 0.0, "min_tokens": 8, "ignore_eos": False},
                   {"temperature": 0.0, "repetition_penalty": 1.8},
                   {"temperature": 1.2, "seed": 8, "presence_penalty": 1.5, "frequency_penalty": -0.5}):
        params = {**fields, "logit_bias": {int(k): v for k, v in fields.get("logit_bias", {}).items()}}
        params.pop("ignore_eos", None)
        assert _complete(client, **fields)["choices"][0]["text"] == expected(**params), fields
