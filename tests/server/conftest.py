"""Fixtures for the server tests: in-process apps over the reference backend (fast, for the many
error cases), and the tiny chat checkpoint the live-server tests serve."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL as MODEL
from server_harness import RLIMIT_NOFILE_KEY, ServerPool, plugin_installed, reference_engine

from gemmaserve.engine.engine import Engine
from gemmaserve.server.app import create_app
from gemmaserve.testing.reference_backend import ReferenceBackend


@pytest.fixture
def make_client() -> Iterator[Callable[..., tuple[TestClient, Engine]]]:
    """``make_client(backend=None, **settings) -> (client, engine)``; engines are shut down after the test."""
    engines: list[Engine] = []

    def make(backend: ReferenceBackend | None = None, **overrides: Any) -> tuple[TestClient, Engine]:
        engine = reference_engine(backend, **overrides)
        engines.append(engine)
        return TestClient(create_app(engine, MODEL), raise_server_exceptions=False), engine

    yield make
    for engine in engines:
        engine.shutdown(timeout=10)


@pytest.fixture(scope="module")
def ref() -> Iterator[tuple[TestClient, Engine]]:
    """One shared app over the reference backend, for tests that do not care about other requests."""
    engine = reference_engine()
    yield TestClient(create_app(engine, MODEL), raise_server_exceptions=False), engine
    engine.shutdown(timeout=10)


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 4 checkpoint with a chat template (built once per session)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from server_harness import build_chat_checkpoint

    return build_chat_checkpoint(tmp_path_factory.mktemp("server-ckpt") / "tiny-gemma4")


OVERLOAD_BACKEND = "custom-cpu" if plugin_installed("gemmaserve_custom_torch") else "hf"
LIVE_CONFIGS: dict[str, dict[str, str]] = {
    "hf": {"BACKEND": "hf"},
    "custom-cpu": {"BACKEND": "custom-cpu"},
    "overload": {"BACKEND": OVERLOAD_BACKEND, "MAX_WAITING_REQUESTS": "1", "MAX_BATCH_SIZE": "1"},
    # short client timeouts, 3 connections, 256 file descriptors (tests/server/test_live_connections.py)
    "guarded": {"BACKEND": OVERLOAD_BACKEND, "TIMEOUT_KEEP_ALIVE": "2", "CLIENT_HEADER_TIMEOUT": "1.5",
                "CLIENT_BODY_TIMEOUT": "1.5", "LIMIT_CONCURRENCY": "3", RLIMIT_NOFILE_KEY: "256"},
}
"""Live servers (env on top of DEVICE=cpu, DTYPE=float32): tests get them through ``live_server``."""


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest, chat_checkpoint: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    """Spawns every live server the selected tests use in parallel on first use (see ServerPool)."""
    needed = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if "live_server" in getattr(item, "fixturenames", ()) and callspec is not None:
            needed.add(callspec.params.get("live_server"))
    env = {"MODEL": str(chat_checkpoint)}
    configs = {name: {**env, **config} for name, config in LIVE_CONFIGS.items()}
    pool = ServerPool(configs, needed, tmp_path_factory.mktemp("serve"))
    yield pool
    pool.stop_all()
