"""Test harness for the HTTP server: a tiny chat-capable checkpoint, a `gemmaserve serve` subprocess,
an in-thread uvicorn over an in-process engine, SSE and Prometheus parsing."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from gemmaserve.engine.engine import Engine
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.settings import CoreSettings, load_settings
from gemmaserve.testing.reference_backend import ReferenceBackend

__all__ = [
    "CHAT_TEMPLATE",
    "REFERENCE_MODEL",
    "build_chat_checkpoint",
    "custom_cpu_openai_client",
    "LiveServer",
    "RLIMIT_NOFILE_KEY",
    "ServerPool",
    "ThreadedServer",
    "free_port",
    "sse_events",
    "parse_prometheus",
    "metric",
    "wait_until",
    "plugin_installed",
    "reference_settings",
    "reference_engine",
]

REFERENCE_MODEL = "tiny-ref"
"""The model name the in-process reference-backend apps serve."""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}model:{% endif %}"
)
STARTUP_TIMEOUT_S = 180.0
"""Generous: a loaded 2-core CI box may need a while to import torch and transformers."""

_SETTINGS_ENV = (
    "BACKEND", "DEVICE", "MODEL", "DTYPE", "MAX_ACTIVE_KV_TOKENS", "KV_BLOCK_SIZE", "PREFIX_CACHE_BLOCKS",
    "MAX_BATCH_SIZE", "MAX_MODEL_LEN", "PREFILL_CHUNK_TOKENS", "MAX_WAITING_REQUESTS", "HOST", "PORT", "LOG_LEVEL",
)


def plugin_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _shared_checkpoints() -> ModuleType:
    """The shared tiny-checkpoint builders (``tests/tiny_checkpoints.py``)."""
    import tiny_checkpoints

    return tiny_checkpoints


def build_chat_checkpoint(path: Path) -> Path:
    """The shared tiny random Gemma 4 checkpoint, with CHAT_TEMPLATE in its tokenizer_config.json."""
    _shared_checkpoints().build_tiny_gemma4(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2))
    return path


def reference_settings(**overrides: Any) -> CoreSettings:
    """CPU settings with every value the server tests depend on pinned (env cannot change them)."""
    base: dict[str, Any] = {
        "device": "cpu", "max_active_kv_tokens": 65536, "kv_block_size": 4, "prefix_cache_blocks": 256,
        "max_batch_size": 8, "prefill_chunk_tokens": 64, "max_waiting_requests": 64, "max_model_len": 512,
    }
    return load_settings(**{**base, **overrides})


@contextlib.contextmanager
def custom_cpu_openai_client(checkpoint: Path, model_name: str, **overrides: Any) -> Iterator[Any]:
    """The official ``openai`` client over an in-process app serving ``checkpoint`` on custom-cpu, settings
    :func:`reference_settings` with ``overrides`` (the engine is shut down on exit)."""
    import openai
    from fastapi.testclient import TestClient
    from gemmaserve_custom_torch.backend import CustomTorchBackend
    from gemmaserve_custom_torch.settings import load_custom_settings

    from gemmaserve.server.app import create_app

    settings = reference_settings(model=str(checkpoint), **overrides)
    engine = Engine(CustomTorchBackend.from_checkpoint(checkpoint, "cpu", settings, load_custom_settings()),
                    settings)
    try:
        http = TestClient(create_app(engine, model_name), raise_server_exceptions=False)
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    finally:
        engine.shutdown(timeout=10)


def reference_engine(backend: ReferenceBackend | None = None, **overrides: Any) -> Engine:
    """A started engine over ``backend`` (default: a fresh ReferenceBackend) with a core prefix cache."""
    settings = reference_settings(**overrides)
    backend = backend or ReferenceBackend(max_model_len=512)
    cache = CacheManager(settings.prefix_cache_blocks, settings.kv_block_size)
    backend.set_cache_adapter(cache)
    engine = Engine(backend, settings, cache, owns_backend=True, backend_name="reference")
    engine.start()
    return engine


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate()`` until it returns something truthy; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


RLIMIT_NOFILE_KEY = "_TEST_RLIMIT_NOFILE"
"""In a LiveServer's env: not passed on, but the server process's file-descriptor limit (soft and hard)."""


def _limit_fds(limit: int) -> Any:
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


class LiveServer:
    """``python -m gemmaserve serve`` in a subprocess on a free port, configured through the env.
    Construction only spawns it; :meth:`wait_healthy` waits for ``GET /health``."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{self.port}.log"
        inherited = {
            key: value for key, value in os.environ.items()
            if key not in _SETTINGS_ENV and not key.startswith(("GEMMASERVE_", "CUSTOM_BACKEND_"))
        }
        defaults = {"DEVICE": "cpu", "DTYPE": "float32", "LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1",
                    "ENABLE_DEBUG_ENDPOINTS": "1"}  # the tests read /debug/kv
        self._log = self.log_path.open("w")
        child_env = {**inherited, **defaults, **env}
        nofile = child_env.pop(RLIMIT_NOFILE_KEY, None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gemmaserve", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            env=child_env, cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=None if nofile is None else _limit_fds(int(nofile)),
        )
        self._healthy = False

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> LiveServer:
        deadline = time.monotonic() + timeout
        while not self._healthy:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"the server exited with {code} during startup:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                self._healthy = httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.1)
        return self

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL if it has not exited within 20 s. Idempotent."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


class ServerPool:
    """Live servers by name. The first :meth:`take` spawns every server the session will need at
    once, so their (slow, CPU-bound) startups overlap; each is stopped by its user, the rest at the end."""

    def __init__(self, configs: dict[str, dict[str, str]], needed: set[str], workdir: Path) -> None:
        self.configs = configs
        self.needed = needed & set(configs)
        self.workdir = workdir
        self.servers: dict[str, LiveServer] = {}

    def take(self, name: str) -> LiveServer:
        for key in sorted(self.needed | {name}):
            if key not in self.servers:
                self.servers[key] = LiveServer(self.configs[key], self.workdir)
        server = self.servers[name]
        try:
            return server.wait_healthy()
        except BaseException:
            server.stop()
            raise

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


class ThreadedServer:
    """uvicorn serving ``app`` from a daemon thread of this process (real sockets, real disconnects); ``config``:
    more ``uvicorn.Config`` arguments (e.g. ``http=`` the connection guards' protocol)."""

    def __init__(self, app: Any, **config_args: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=2,
                                **config_args)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def sse_events(text_or_lines: str | Iterator[str]) -> list[Any]:
    """Decode an SSE body: the JSON payload of every ``data:`` line, and ``"[DONE]"`` as a string."""
    lines = text_or_lines.splitlines() if isinstance(text_or_lines, str) else text_or_lines
    events: list[Any] = []
    for line in lines:
        if not line.strip():
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? (\S+)$')


def parse_prometheus(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Strictly parse the text exposition format: every line is a comment (HELP/TYPE) or a sample."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        labels = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"', match.group(2) or ""))
        key = (match.group(1), labels)
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(match.group(3))
    return samples


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample's value (0 when absent: counters with a label set not seen yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def asgi_post(app: Any, path: str, body: bytes,
                    pace: Callable[[dict[str, Any], list[dict[str, Any]]], Awaitable[None]],
                    state: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """POST ``body`` to ``path`` of ``app`` as one ASGI call whose client never disconnects: every message sent goes
    to the returned list, then ``send`` awaits ``pace(message, sent)`` (the client's transport: its reading pace);
    ``state`` is the request scope's state (the connection guards' keys)."""
    sent: list[dict[str, Any]] = []
    inbox = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop()
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        await pace(message, sent)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "state": state}
    await asyncio.wait_for(app(scope, receive, send), timeout_s)
    return sent
