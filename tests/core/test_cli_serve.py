"""`gemmaserve serve` fails fast on an address it cannot listen on (before the model loads), and render workers
stop quietly when the server goes away."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from gemmaserve.cli import main
from gemmaserve.errors import ConfigurationError
from gemmaserve.server.serve import bind_listeners


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr("gemmaserve.engine.factory.build_engine", refuse)


def test_serve_on_a_port_in_use_is_one_error_line_before_the_model_loads(
        busy_port: int, no_model_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--host", "127.0.0.1", "--port", str(busy_port), "--backend", "custom-cpu",
                 "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gemmaserve: error: cannot listen on 127.0.0.1:{busy_port}: Address already in use")
    assert err.count("\n") == 1


@pytest.mark.parametrize("host", ["256.1.1.1", "no-such-host.invalid"])
def test_serve_on_an_unusable_host_is_one_error_line(host: str, no_model_load: None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--host", host, "--port", "8123", "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gemmaserve: error: cannot listen on {host}:8123: ") and err.count("\n") == 1


def test_bind_listeners_binds_without_listening(busy_port: int) -> None:
    """Connections are refused (not left hanging) while the model loads; a port in use names the fix."""
    (sock,) = bind_listeners("127.0.0.1", 0)
    with sock, socket.socket() as client, pytest.raises(ConnectionRefusedError):
        client.connect(sock.getsockname())
    with pytest.raises(ConfigurationError, match=rf"cannot listen on 127.0.0.1:{busy_port}: .*pick another --port"):
        bind_listeners("127.0.0.1", busy_port)
    listeners = bind_listeners("localhost", 0)  # every address the name resolves to, as uvicorn would listen
    for listener in listeners:
        assert listener.getsockname()[0] in ("127.0.0.1", "::1")
        listener.close()


def test_a_render_worker_whose_server_is_gone_exits_quietly() -> None:
    """The server exits while the worker starts (uvicorn could not bind): its ready answer used to raise
    BrokenPipeError with a traceback on the terminal, after the server had exited."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    worker = subprocess.Popen([sys.executable, "-m", "gemmaserve.render_pool"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert worker.stdin is not None and worker.stdout is not None and worker.stderr is not None
    worker.stdout.close()  # nobody will read the answers
    worker.stdin.write(pickle.dumps("a tokenizer"))
    worker.stdin.close()
    assert worker.wait(timeout=60) == 0
    assert worker.stderr.read() == b""
    worker.stderr.close()


@pytest.mark.parametrize("value", ["a,,b", ",", "a,", " "])
def test_served_model_name_with_an_empty_name_is_refused_like_the_flag(
        value: str, no_model_load: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The env used to drop empty names silently (',' meant the folder's name); the flag refuses them."""
    from gemmaserve.server.serve import model_names
    from gemmaserve.settings import load_settings

    with pytest.raises(ConfigurationError, match="each comma-separated name must be non-empty"):
        model_names(load_settings(served_model_name=value), "fallback")
    monkeypatch.setenv("SERVED_MODEL_NAME", value)
    assert main(["serve", "--port", "0", "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gemmaserve: error: SERVED_MODEL_NAME={value!r}: ") and err.count("\n") == 1
    assert main(["serve", "--served-model-name", "", "--port", "0"]) == 2  # the flag, as before
    assert "--served-model-name: each name must be non-empty" in capsys.readouterr().err


def test_served_model_name_unset_or_listed_still_works() -> None:
    from gemmaserve.server.serve import model_names
    from gemmaserve.settings import load_settings

    assert model_names(load_settings(served_model_name=""), "fallback") == ["fallback"]
    assert model_names(load_settings(served_model_name=" a , b "), "fallback") == ["a", "b"]
