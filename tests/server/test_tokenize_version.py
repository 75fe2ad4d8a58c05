"""vLLM's /tokenize and /detokenize shapes, /version, ``--served-model-name`` and ``gemmaserve --version``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL, reference_engine

import gemmaserve
from gemmaserve.cli import main
from gemmaserve.engine.engine import Engine
from gemmaserve.server.app import create_app
from gemmaserve.server.serve import model_names
from gemmaserve.settings import load_settings
from gemmaserve.testing.reference_model import BOS_ID


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = reference_engine()
    yield engine
    engine.shutdown(timeout=10)


@pytest.fixture(scope="module")
def client(engine: Engine) -> TestClient:
    return TestClient(create_app(engine, REFERENCE_MODEL), raise_server_exceptions=False)


def error(response: Any, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_tokenize_a_prompt(client: TestClient, engine: Engine) -> None:
    tokenizer = engine.backend.tokenizer
    body = client.post("/tokenize", json={"model": REFERENCE_MODEL, "prompt": "hello"}).json()
    assert body == {"count": 6, "max_model_len": 512, "tokens": tokenizer.encode("hello"), "token_strs": None}
    assert body["tokens"][0] == BOS_ID
    plain = client.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()
    assert plain["tokens"] == body["tokens"][1:] and plain["count"] == 5


def test_tokenize_messages_is_what_chat_prefills(client: TestClient, engine: Engine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()
    assert body["tokens"] == engine.backend.tokenizer.apply_chat_template(messages)
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({}, "prompt", "either 'prompt'"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages", "not both"),
    ({"prompt": 5}, "prompt", "string"),
    ({"prompt": "a", "return_token_strs": True}, "return_token_strs", "does not expose"),  # a toy vocabulary
    # the reference tokenizer renders messages only (tests/server/test_chat_template_options.py has the options)
    ({"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": False}, "add_generation_prompt",
     "not supported"),
    ({"prompt": "a", "continue_final_message": False}, "continue_final_message", "messages only"),
    ({"messages": [{"role": "user", "content": "b"}], "continue_final_message": True}, "continue_final_message",
     "not supported"),
    ({"messages": [{"role": "user", "content": "b"}], "chat_template": "{{x}}"}, "chat_template", "not supported"),
    ({"messages": [{"role": "user", "content": "b"}], "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs",
     "not supported"),
    ({"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True}, "add_special_tokens",
     "chat template adds"),
    ({"prompt": "x" * 600}, "prompt", "context"),
])
def test_tokenize_refuses_what_it_does_not_do(client: TestClient, body: dict, param: str, fragment: str) -> None:
    err = error(client.post("/tokenize", json=body))
    assert err["param"] == param and fragment in err["message"], err


def test_detokenize_round_trips(client: TestClient) -> None:
    tokens = client.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert client.post("/detokenize", json={"model": REFERENCE_MODEL, "tokens": tokens[1:]}).json() == {
        "prompt": "hello"}
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"].endswith("hello")
    err = error(client.post("/detokenize", json={"tokens": [1, 64]}))
    assert err["param"] == "tokens" and "outside the vocabulary" in err["message"]
    assert error(client.post("/detokenize", json={"tokens": [-1]}))["param"] == "tokens"
    assert error(client.post("/detokenize", json={"tokens": [1] * 513}))["param"] == "tokens"
    assert error(client.post("/detokenize", json={"tokens": [1], "model": "other"}), 404)["code"] == "model_not_found"
    assert error(client.post("/tokenize", content=b"prompt=a", headers={"content-type": "text/plain"}), 415)


def test_version(client: TestClient, capsys: pytest.CaptureFixture[str]) -> None:
    assert client.get("/version").json() == {"version": gemmaserve.__version__}
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gemmaserve {gemmaserve.__version__}"


def test_served_model_names_are_listed_and_accepted(engine: Engine) -> None:
    app = create_app(engine, "first", extra_model_names=["second"])
    client = TestClient(app, raise_server_exceptions=False)
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["first", "second"]
    assert client.get("/v1/models/second").json()["id"] == "second"
    for name in ("first", "second"):
        reply = client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
        assert reply.status_code == 200 and reply.json()["model"] == "first"
    err = error(client.post("/v1/completions", json={"model": REFERENCE_MODEL, "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and "'first' or 'second'" in err["message"]


def test_served_model_name_setting_and_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    assert model_names(load_settings(model=str(tmp_path / "ckpt")), "fallback") == ["ckpt"]
    assert model_names(load_settings(served_model_name="a, b"), "fallback") == ["a", "b"]
    seen: dict[str, Any] = {}
    monkeypatch.setattr("gemmaserve.server.serve.serve", lambda settings: seen.setdefault("s", settings))
    assert main(["serve", "--served-model-name", "gemma", "my-alias"]) == 0
    assert seen["s"].served_model_name == "gemma,my-alias"
    assert main(["serve", "--served-model-name", "a,b"]) == 2


def test_tokenize_returns_the_vocabularys_token_strings(chat_checkpoint) -> None:
    """vLLM's ``return_token_strs: true`` on a Hugging Face tokenizer: ``token_strs`` are transformers'
    ``convert_ids_to_tokens`` of the ids."""
    from server_harness import custom_cpu_openai_client
    from transformers import AutoTokenizer

    with custom_cpu_openai_client(chat_checkpoint, "m") as openai_client:
        http = openai_client._client
        body = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
        assert body["token_strs"] == AutoTokenizer.from_pretrained(chat_checkpoint).convert_ids_to_tokens(
            body["tokens"]) and len(body["token_strs"]) == body["count"]
        assert http.post("/tokenize", json={"prompt": "hi"}).json()["token_strs"] is None
