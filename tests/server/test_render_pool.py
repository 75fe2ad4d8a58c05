"""Chat templates rendered in worker processes (issue 17 item 4): the render pool gives the same token ids and the
same errors as rendering in-process, a worker that dies is replaced, and the app's lifespan starts and stops it.
Timing (the stall it removes) is left to ``benchmarks/loop_stall.py``."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL, reference_engine

from gemmaserve.hf_tokenizer import HFTokenizerAdapter
from gemmaserve.render_pool import RenderPool, RenderWorkerDied
from gemmaserve.server import prepare
from gemmaserve.server.app import create_app
from gemmaserve.server.errors import APIError
from gemmaserve.testing.reference_backend import ReferenceBackend

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[tools:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}]{% endif %}"
    "{% if greeting is defined %}<{{ greeting }}>{% endif %}"
    "{% if refuse is defined %}{{ raise_exception('refused: ' ~ refuse) }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}model:{% endif %}"
)
GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
LONG = "the quick brown fox jumps over the lazy dog " * 120
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
SHAPES: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "hi"}], {}),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG}], {}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": LONG}], {}),
    ([{"role": "user", "content": LONG}], {"add_generation_prompt": False}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "Once upon"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
]
KWARG_SHAPES: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": LONG}], {"template_kwargs": {"tools": WEATHER}}),
    ([{"role": "user", "content": "hi"}], {"template_kwargs": {"greeting": "hello"}}),
]


def _adapter(template: str | None = None) -> HFTokenizerAdapter:
    """The tiny trained tokenizer with Gemma's turn tokens: Gemma's own turn format unless ``template`` is given
    (as ``--chat-template``)."""
    pytest.importorskip("transformers")
    import tiny_checkpoints
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tiny_checkpoints._train_tokenizer_json(GEMMA_TURN_TOKENS)),
        pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
    )
    adapter = HFTokenizerAdapter(fast, "tiny")
    if template is not None:
        adapter.set_chat_template(template)
    return adapter


class _KillsTheWorker:
    """Unpickling this in a worker ends that process at once (as a crash would)."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return os._exit, (3,)


@pytest.fixture(scope="module")
def gemma() -> Iterator[tuple[HFTokenizerAdapter, RenderPool]]:
    adapter = _adapter()
    assert adapter.chat_template_source == "gemma-default"
    pool = RenderPool(adapter, 1)
    yield adapter, pool
    pool.close()


@pytest.fixture(scope="module")
def custom() -> Iterator[tuple[HFTokenizerAdapter, RenderPool]]:
    adapter = _adapter(TOOLS_TEMPLATE)
    assert adapter.chat_template_source == "configured"
    pool = RenderPool(adapter, 1)
    yield adapter, pool
    pool.close()


@pytest.mark.parametrize(("messages", "options"), SHAPES)
def test_the_gemma_template_renders_the_same_ids_in_a_worker(gemma: Any, messages: Any, options: Any) -> None:
    adapter, pool = gemma
    assert pool.apply_chat_template(messages, **options) == adapter.apply_chat_template(messages, **options)


@pytest.mark.parametrize(("messages", "options"), SHAPES + KWARG_SHAPES)
def test_a_configured_template_renders_the_same_ids_in_a_worker(custom: Any, messages: Any, options: Any) -> None:
    adapter, pool = custom
    ids = pool.apply_chat_template(messages, **options)
    assert ids == adapter.apply_chat_template(messages, **options)
    if "tools" in options.get("template_kwargs", {}):
        assert "[tools:get_weather;]" in adapter.decode(ids)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_prompts_tokenize_the_same_in_a_worker(gemma: Any, add_special_tokens: bool) -> None:
    adapter, pool = gemma
    text = LONG + " <start_of_turn> émoji ✓"
    assert pool.encode(text, add_special_tokens=add_special_tokens) == adapter.encode(
        text, add_special_tokens=add_special_tokens)


def test_template_errors_come_back_with_the_same_400(gemma: Any) -> None:
    adapter, pool = gemma
    messages = [{"role": "user", "content": LONG}, {"role": "user", "content": "again"}]  # roles must alternate
    errors = []
    for use in (None, pool):
        with pytest.raises(APIError) as caught:
            prepare.render_chat(messages, adapter, 100_000, None, use)
        errors.append((caught.value.status, str(caught.value), caught.value.body()))
    assert errors[0] == errors[1]
    assert errors[0][0] == 400 and "Conversation roles must alternate" in errors[0][1]


def test_a_dead_worker_is_replaced_and_the_call_retried(gemma: Any) -> None:
    adapter, pool = gemma
    messages = [{"role": "user", "content": LONG}]
    pool.apply_chat_template(messages)
    [pid] = pool.worker_pids()
    os.kill(pid, signal.SIGKILL)
    assert pool.apply_chat_template(messages) == adapter.apply_chat_template(messages)
    assert pool.worker_pids() != [pid] and len(pool.worker_pids()) == 1


def test_a_request_that_kills_workers_fails_cleanly_and_the_pool_recovers(gemma: Any) -> None:
    adapter, pool = gemma
    messages = [{"role": "user", "content": LONG}]
    with pytest.raises(RenderWorkerDied):
        pool.apply_chat_template(messages, template_kwargs={"bomb": _KillsTheWorker()})
    with pytest.raises(APIError) as caught:
        prepare.render_chat(messages, adapter, 100_000, {"template_kwargs": {"bomb": _KillsTheWorker()}}, pool)
    assert caught.value.status == 500 and "worker process died twice" in str(caught.value)
    assert pool.apply_chat_template(messages) == adapter.apply_chat_template(messages)
    assert len(pool.worker_pids()) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_do_not_load_torch(gemma: Any) -> None:
    _, pool = gemma
    pool.apply_chat_template([{"role": "user", "content": "hi"}])
    for pid in pool.worker_pids():
        maps = open(f"/proc/{pid}/maps").read()
        assert "libtorch" not in maps and "/torch/" not in maps


def test_the_app_renders_long_chats_in_its_pool_and_its_lifespan_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = ReferenceBackend(vocab_size=512, max_model_len=4096)
    backend.tokenizer = adapter = _adapter(TOOLS_TEMPLATE)
    engine = reference_engine(backend, max_model_len=4096, max_active_kv_tokens=65536)
    try:
        app = create_app(engine, REFERENCE_MODEL)
        pool = app.state.render_pool
        assert isinstance(pool, RenderPool)
        calls: list[int] = []
        real = pool.apply_chat_template
        monkeypatch.setattr(pool, "apply_chat_template", lambda m, **o: calls.append(1) or real(m, **o))
        body = {"messages": [{"role": "user", "content": LONG * 2}], "max_tokens": 1, "temperature": 0}
        with TestClient(app, raise_server_exceptions=False) as client:
            tokenized = client.post("/tokenize", json={"messages": body["messages"]})
            assert tokenized.status_code == 200
            assert tokenized.json()["tokens"] == adapter.apply_chat_template(body["messages"])
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == len(tokenized.json()["tokens"])
            bad = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"refuse": "no"}})
            assert len(calls) == 3, bad.text
            pids = pool.worker_pids()
            assert pids
        with pytest.raises(APIError) as in_process:
            prepare.render_chat(body["messages"], adapter, 4096, {"template_kwargs": {"refuse": "no"}})
        assert bad.status_code == in_process.value.status == 400 and bad.json() == in_process.value.body()
        assert "refused: no" in bad.json()["error"]["message"]
        assert pool.worker_pids() == []
        with pytest.raises(RuntimeError, match="closed"):
            pool.apply_chat_template(body["messages"])
        with TestClient(app, raise_server_exceptions=False) as client:  # served again: the lifespan reopens it
            assert client.post("/tokenize", json={"messages": body["messages"]}).json() == tokenized.json()
        assert pool.worker_pids() == []
    finally:
        engine.shutdown(timeout=10)


def test_a_template_changed_after_the_pool_was_made_renders_in_process() -> None:
    adapter = _adapter(TOOLS_TEMPLATE)
    pool = RenderPool(adapter, 1)
    try:
        assert pool.serves(adapter) and not pool.serves(_adapter(TOOLS_TEMPLATE))
        adapter.set_chat_template("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
        assert not pool.serves(adapter)
        messages = [{"role": "user", "content": LONG}]
        assert prepare.render_chat(messages, adapter, 100_000, None, pool) == adapter.apply_chat_template(messages)
        assert pool.worker_pids() == []  # never used
    finally:
        pool.close()


def test_no_pool_without_render_processes_or_for_a_tokenizer_of_the_backend() -> None:
    engine = reference_engine(ReferenceBackend(max_model_len=512))  # its CharTokenizer is no Hugging Face one
    try:
        assert create_app(engine, REFERENCE_MODEL).state.render_pool is None
    finally:
        engine.shutdown(timeout=10)
    assert RenderPool.for_tokenizer(object(), 0) is None


_INTERRUPTED_SERVER = """
import os, pickle, signal, sys, time
from gemmaserve.render_pool import RenderPool

if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda *_: print("server got SIGINT", file=sys.stderr))  # uvicorn's: it drains
    pool = RenderPool(pickle.load(open(sys.argv[1], "rb")), 2)
    pool.start()
    time.sleep(0.2)  # the workers are still importing
    os.killpg(0, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole foreground process group
    messages = [{"role": "user", "content": "x" * 5000}]
    first = pool.apply_chat_template(messages)
    time.sleep(1.0)
    pids = sorted(pool.worker_pids())
    os.killpg(0, signal.SIGINT)  # again, once they idle
    time.sleep(0.5)
    assert pool.apply_chat_template(messages) == first
    print(pids == sorted(pool.worker_pids()), flush=True)
    pool.close()
"""


def test_a_terminal_interrupt_neither_kills_nor_fails_starting_or_idle_workers(tmp_path: Any) -> None:
    """Ctrl-C reaches every process of the terminal's foreground group; the server drains before its lifespan
    closes the pool, so the workers must not die of it (they did: a worker still starting was logged as a
    RenderWorkerDied start failure with both processes' KeyboardInterrupt tracebacks, an idle one was replaced
    at the next call)."""
    import pickle
    import subprocess

    tokenizer = tmp_path / "tokenizer.pickle"
    tokenizer.write_bytes(pickle.dumps(_adapter()))
    script = tmp_path / "server.py"
    script.write_text(_INTERRUPTED_SERVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, str(script), str(tokenizer)], capture_output=True, text=True, env=env,
                          timeout=120, start_new_session=True)  # its own process group, signalled by itself
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stderr
    assert "server got SIGINT" in done.stderr
    for symptom in ("KeyboardInterrupt", "RenderWorkerDied", "could not start", "died"):
        assert symptom not in done.stderr, done.stderr


def test_a_pool_reopened_while_its_workers_start_keeps_its_size() -> None:
    """close() then start() (an app's lifespan run twice, quickly) while a worker is still starting: that worker
    belongs to the closed pool and must be stopped, not join the reopened one (the pool grew past ``processes``)."""
    import threading
    import time

    pool = RenderPool(_adapter(), 1)
    try:
        pool.start()
        time.sleep(0.1)  # the first worker is importing
        pool.close()
        pool.start()
        messages = [{"role": "user", "content": LONG}]
        assert pool.apply_chat_template(messages) == pool._tokenizer.apply_chat_template(messages)
        deadline = time.monotonic() + 60
        while any(t.name.startswith("gemmaserve-render-start") for t in threading.enumerate()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(pool.worker_pids()) == 1 and pool._idle.qsize() == 1
    finally:
        pool.close()
    assert pool.worker_pids() == []
