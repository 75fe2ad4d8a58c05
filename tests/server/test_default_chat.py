"""Chat on the default model out of the box (issue 16 item 5): a Gemma-family tokenizer without a chat template
renders chats in the Gemma turn format, ``<end_of_turn>`` ends a chat, and the README's and docs/api.md's chat
examples answer on the default model (Gemma 3 270M, whose GGUF ships no template)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL, ThreadedServer, sse_events

from gemmaserve.errors import InvalidRequestError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.hf_tokenizer import GEMMA_CHAT_TEMPLATE, HFTokenizerAdapter
from gemmaserve.models import default_model as dm
from gemmaserve.server.app import create_app
from gemmaserve.testing.reference_backend import ReferenceBackend
from gemmaserve.testing.reference_model import CharTokenizer

ROOT = Path(__file__).resolve().parents[2]
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]


def _tiny_hf_tokenizer(extra_specials: list[str] = (), chat_template: str | None = None) -> Any:
    pytest.importorskip("transformers")
    import tiny_checkpoints
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tiny_checkpoints._train_tokenizer_json()),
        pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        additional_special_tokens=list(extra_specials),
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def test_a_gemma_family_tokenizer_without_a_template_gets_the_gemma_turn_format() -> None:
    adapter = HFTokenizerAdapter(_tiny_hf_tokenizer(TURN_TOKENS), "tiny-gemma")
    assert adapter.has_chat_template and adapter.chat_template_source == "gemma-default"
    end_of_turn = adapter.encode("<end_of_turn>", add_special_tokens=False)
    assert len(end_of_turn) == 1 and adapter.chat_stop_token_ids == tuple(end_of_turn)

    def render(messages: list[dict[str, str]]) -> str:
        return adapter.decode(adapter.apply_chat_template(messages), skip_special_tokens=False)

    assert render([{"role": "user", "content": "Hello!"}]) == (
        "<bos><start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n")
    assert render([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
    ]) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
           "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(InvalidRequestError, match="alternate"):
        adapter.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_the_tokenizers_own_template_wins_and_other_tokenizers_get_none() -> None:
    own = "{% for m in messages %}{{ m['content'] }}<end_of_turn>{% endfor %}"
    adapter = HFTokenizerAdapter(_tiny_hf_tokenizer(TURN_TOKENS, chat_template=own))
    assert adapter.chat_template == own and adapter.chat_template_source == "tokenizer"
    assert len(adapter.chat_stop_token_ids) == 1  # the template writes <end_of_turn>
    plain = HFTokenizerAdapter(_tiny_hf_tokenizer())  # no turn tokens in the vocabulary: not Gemma
    assert not plain.has_chat_template and plain.chat_template_source is None and plain.chat_stop_token_ids == ()
    with pytest.raises(InvalidRequestError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_converter_carries_a_gguf_chat_template() -> None:
    config: dict[str, Any] = {}
    dm._carry_chat_template({"tokenizer.chat_template": "{{ messages }}"}, config)
    assert config == {"chat_template": "{{ messages }}"}
    config = {}
    dm._carry_chat_template({}, config)  # the shipped GGUF: none, the adapter's Gemma format applies
    assert config == {}


class _TurnEndTokenizer(CharTokenizer):
    """The reference tokenizer with one turn-end token (what HFTokenizerAdapter finds in a Gemma template)."""

    def __init__(self, vocab_size: int, turn_end: int) -> None:
        super().__init__(vocab_size)
        self.chat_stop_token_ids = (turn_end,)


def test_a_chat_without_max_tokens_ends_at_the_turn_end_token(make_client: Any) -> None:
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "temperature": 0}
    backend = ReferenceBackend()
    client, engine = make_client(backend, default_max_tokens=64)
    # the greedy continuation is deterministic: make one of its later tokens the template's turn end
    prompt = backend.tokenizer.apply_chat_template(body["messages"])
    ids = engine.generate([prompt], [SamplingParams(max_tokens=20, ignore_eos=True)])[0].token_ids
    turn_end = next(token for i, token in enumerate(ids) if i >= 3 and token not in ids[:i])
    backend.tokenizer = _TurnEndTokenizer(64, turn_end)
    client = TestClient(create_app(engine, REFERENCE_MODEL), raise_server_exceptions=False)
    reply = client.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == ids.index(turn_end) + 1  # counted, like EOS
    # completions are not chats: no turn end there
    plain = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0}).json()
    assert plain["usage"]["completion_tokens"] == 20 or plain["choices"][0]["finish_reason"] == "stop"
    # ignore_eos (benchmarks) runs past it, as past EOS
    past = client.post("/v1/chat/completions", json={**body, "ignore_eos": True, "max_tokens": 20}).json()
    assert past["usage"]["completion_tokens"] == 20


# -- the default model ------------------------------------------------------------------------------------------

needs_default_model = pytest.mark.skipif(not dm.is_default_model_ready(),
                                         reason="the default model is not converted here (make run does it)")


@needs_default_model
def test_the_default_models_tokenizer_renders_gemma_turns_and_stops_at_end_of_turn() -> None:
    pytest.importorskip("transformers")
    from gemmaserve.hf_tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(dm.default_model_dir())
    assert tokenizer.chat_template == GEMMA_CHAT_TEMPLATE and tokenizer.chat_template_source == "gemma-default"
    assert tokenizer.chat_stop_token_ids == (106,)  # <end_of_turn>
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert ids == [2, 105, 2364, 107, 9259, 236888, 106, 107, 105, 4368, 107]


@pytest.fixture(scope="module")
def default_server() -> Iterator[ThreadedServer]:
    """``gemmaserve serve`` as ``make run`` leaves it: the default model, the backend chosen for this machine."""
    pytest.importorskip("torch")
    from gemmaserve.engine.factory import build_engine
    from gemmaserve.settings import load_settings

    settings = load_settings(model=str(dm.default_model_dir()), backend=None, device="cpu", max_model_len=1024)
    engine = build_engine(settings)
    engine.start()
    server = ThreadedServer(create_app(engine, dm.DEFAULT_MODEL_NAME))
    yield server
    server.stop()
    engine.shutdown(timeout=10)


def _code_blocks(path: Path, language: str, must_contain: str) -> list[str]:
    blocks = re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)
    return [block for block in blocks if must_contain in block]


@pytest.mark.slow
@needs_default_model
@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_the_docs_openai_chat_examples_answer_on_the_default_model(doc: str, default_server: ThreadedServer,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("openai")
    blocks = _code_blocks(ROOT / doc, "python", "chat.completions.create")
    assert blocks, f"{doc} has no openai chat example"
    for block in blocks:
        exec(compile(block.replace("http://127.0.0.1:8000", default_server.base_url), doc, "exec"), {})
    assert capsys.readouterr().out.strip()  # the examples print the reply


@pytest.mark.slow
@needs_default_model
@pytest.mark.parametrize(("doc", "language"), [("README.md", "sh"), ("docs/api.md", "bash")])
def test_the_docs_curl_chat_examples_answer_on_the_default_model(doc: str, language: str,
                                                                 default_server: ThreadedServer) -> None:
    import httpx

    blocks = _code_blocks(ROOT / doc, language, "/v1/chat/completions")
    bodies = [json.loads(body) for block in blocks
              for body in re.findall(r"chat/completions.*?-d '(.*?)'", block, flags=re.S)]
    assert bodies
    for body in bodies:
        response = httpx.post(f"{default_server.base_url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        if body.get("stream"):
            events = sse_events(response.text)
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] >= 1
            assert events[-3]["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert response.json()["choices"][0]["message"]["role"] == "assistant"
