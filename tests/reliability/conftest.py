"""Fixtures of the reliability tests: the live servers they use, spawned together on first use (their
CPU-bound startups overlap), over one tiny random Gemma 4 checkpoint built once per session.

- ``load_server``: custom-cpu, default batch size, MAX_WAITING_REQUESTS=160 (load, disconnects, fuzzing);
- ``faulty_server``: the fault plugin around custom-cpu: poison sequence ``POISON`` fails a row two
  tokens after it; 20 ms per decode step; MAX_BATCH_SIZE=4 (backend faults, cancels while queued);
- ``tiny_kv_server``: custom-cpu with an 8-block KV pool and a queue of 4 (KV exhaustion);
- ``draining_server``: the fault plugin without poison, 20 ms per decode step, SHUTDOWN_TIMEOUT=3 (the drain
  test stops it with SIGTERM).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from loadgen import SERVER_ENV
from reliability_harness import (
    POISON,
    LiveServer,
    build_chat_checkpoint,
    install_fault_plugin,
    require_custom_torch,
    with_pythonpath,
)

SERVERS: dict[str, dict[str, str]] = {
    "load_server": SERVER_ENV,
    "faulty_server": {
        "BACKEND": "faulty", "FAULT_POISON": ",".join(map(str, POISON)), "FAULT_POISON_AFTER": "2",
        "FAULT_DECODE_DELAY_S": "0.02", "MAX_BATCH_SIZE": "4", "MAX_WAITING_REQUESTS": "16",
    },
    # SIGTERM-ed by test_drain_live.py: 20 ms per decode step, so stream lengths set what ends within the drain
    "draining_server": {"BACKEND": "faulty", "FAULT_DECODE_DELAY_S": "0.02", "SHUTDOWN_TIMEOUT": "3",
                        "LOG_LEVEL": "info"},
    "tiny_kv_server": {
        "BACKEND": "custom-cpu", "CUSTOM_BACKEND_KV_BLOCKS": "8", "MAX_WAITING_REQUESTS": "4",
        "MAX_BATCH_SIZE": "8",
    },
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 4 checkpoint (with a chat template), built once per session."""
    require_custom_torch()
    return build_chat_checkpoint(tmp_path_factory.mktemp("reliability-ckpt") / "tiny-gemma4")


class _Pool:
    """Spawns every server the session's tests use at the first request for any of them."""

    def __init__(self, needed: set[str], workdir: Path) -> None:
        self.needed = needed
        self.workdir = workdir
        self.servers: dict[str, LiveServer] = {}

    def take(self, name: str, checkpoint: Path) -> LiveServer:
        if not self.servers:
            keys = sorted(self.needed | {name})
            faulty = [key for key in keys if SERVERS[key]["BACKEND"] == "faulty"]
            site = install_fault_plugin(self.workdir / "fault_site") if faulty else None
            for key in keys:
                env = {**SERVERS[key], "MODEL": str(checkpoint)}
                if key in faulty:
                    assert site is not None
                    env = with_pythonpath(env, site)
                self.servers[key] = LiveServer(env, self.workdir)
        return self.servers[name].wait_healthy()

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def reliability_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Pool]:
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ()) if name in SERVERS}
    pool = _Pool(needed, tmp_path_factory.mktemp("reliability"))
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def load_server(reliability_pool: _Pool, tiny_checkpoint: Path) -> LiveServer:
    return reliability_pool.take("load_server", tiny_checkpoint)


@pytest.fixture(scope="session")
def faulty_server(reliability_pool: _Pool, tiny_checkpoint: Path) -> LiveServer:
    return reliability_pool.take("faulty_server", tiny_checkpoint)


@pytest.fixture(scope="session")
def draining_server(reliability_pool: _Pool, tiny_checkpoint: Path) -> LiveServer:
    return reliability_pool.take("draining_server", tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_kv_server(reliability_pool: _Pool, tiny_checkpoint: Path) -> LiveServer:
    return reliability_pool.take("tiny_kv_server", tiny_checkpoint)
