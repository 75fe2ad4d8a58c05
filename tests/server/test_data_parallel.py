"""``gemmaserve serve --data-parallel-size 2``: two replicas of the tiny checkpoint behind the real vllm-router
(loopback only). Requests spread over the replicas and shared prefixes follow their cache; a replica killed
mid-load loses only its own streams (they end at once, no hang), the rest complete, and it is restarted and
serves again; SIGTERM drains and exits 0. Flag checks run in-process and start nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import free_port, parse_prometheus, plugin_installed, wait_until

from gemmaserve.cli import main
from gemmaserve.errors import ConfigurationError
from gemmaserve.server import data_parallel
from gemmaserve.server.data_parallel import CORS_NOWHERE, REPLICA_LOG_LINE, plan_launch, visible_gpus
from gemmaserve.settings import load_settings

ROUTER_MISSING = any(importlib.util.find_spec(name) is None for name in data_parallel.ROUTER_MODULES)
needs_router = pytest.mark.skipif(ROUTER_MISSING, reason="vllm-router not installed (pip install 'gemmaserve[router]')")
API_KEY = "dp-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BACKEND = "custom-cpu" if plugin_installed("gemmaserve_custom_torch") else "hf"
STARTUP_S = 180.0
_SETTINGS_ENV = ("BACKEND", "DEVICE", "MODEL", "DTYPE", "HOST", "PORT", "LOG_LEVEL", "API_KEY", "VLLM_API_KEY",
                 "ALLOWED_HOSTS", "ALLOWED_ORIGINS", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


# -- flags and planning: no process is started -----------------------------------------------------------
def test_bad_size_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    for size in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--data-parallel-size", size])
        assert exc.value.code == 2
        assert "must be an integer >= 1" in capsys.readouterr().err


def test_router_policy_needs_data_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--router-policy", "round_robin"]) == 2
    assert "needs --data-parallel-size 2 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "-dp", "2", "--router-policy", "random"])
    assert "invalid choice" in capsys.readouterr().err


def test_missing_router_names_the_package(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(data_parallel, "ROUTER_MODULES", ("gemmaserve_no_such_router_module",))
    assert main(["serve", "--data-parallel-size", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'gemmaserve[router]'" in err and "vllm-router" in err


@needs_router
def test_a_public_port_in_use_is_refused_before_any_replica_starts(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The router's --port already taken: one error line and exit 2 at once, no replica launched (it used to be
    found once every replica had loaded its model)."""
    import socket

    monkeypatch.setattr(data_parallel, "require_router", lambda: None)
    monkeypatch.setattr(data_parallel, "_Supervisor", lambda plan: pytest.fail("replicas were launched"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--data-parallel-size", "2", "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Address already in use" in err


def test_data_parallel_with_tensor_parallel_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "-dp", "2", "--device", "cpu", "--tensor-parallel-size", "2"]) == 2
    assert "cannot be tensor parallel yet" in capsys.readouterr().err


@needs_router
def test_data_parallel_with_expert_parallel_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "-dp", "2", "--device", "cpu", "--enable-expert-parallel"]) == 2
    assert "replicas do not share experts" in capsys.readouterr().err


@needs_router
def test_client_facing_settings_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "-dp", "2", "--device", "cpu", "--allowed-hosts", "example.com"]) == 2
    assert "--allowed-hosts" in capsys.readouterr().err
    assert main(["serve", "-dp", "2", "--device", "cpu", "--client-header-timeout", "3"]) == 2
    assert "--client-header-timeout" in capsys.readouterr().err
    assert main(["serve", "-dp", "2", "--device", "cpu", "--port", "0"]) == 2
    assert "--port 0" in capsys.readouterr().err


@pytest.mark.parametrize("name, value", [("ALLOWED_HEADERS", "x-a"), ("ALLOWED_METHODS", "GET"),
                                         ("ALLOW_CREDENTIALS", "1")])
def test_cors_allowances_from_the_environment_are_refused_too(monkeypatch: pytest.MonkeyPatch, name: str,
                                                              value: str) -> None:
    """The router answers CORS: what only a replica would allow is refused, from the environment as from flags."""
    monkeypatch.setenv("ALLOWED_ORIGINS", "https://a.example")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=rf"\({name}\): the router answers CORS"):
        plan_launch(load_settings(device="cpu"), 2, "cache_aware", [], None, env={})


def test_replicas_are_pinned_one_gpu_each() -> None:
    settings = load_settings(device="cuda")
    plan = plan_launch(settings, 2, "cache_aware", ["--model=/m"], None, env={"CUDA_VISIBLE_DEVICES": "3,GPU-ab,7"})
    assert [replica.env for replica in plan.replicas] == [{"CUDA_VISIBLE_DEVICES": "3", "DATA_PARALLEL_RANK": "0"},
                                                           {"CUDA_VISIBLE_DEVICES": "GPU-ab", "DATA_PARALLEL_RANK": "1"}]
    with pytest.raises(ConfigurationError, match="one replica per GPU, but 3 GPU"):
        plan_launch(settings, 4, "cache_aware", [], None, env={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    with pytest.raises(ConfigurationError, match="no CUDA GPU is visible"):
        plan_launch(settings, 2, "cache_aware", [], None, env={"CUDA_VISIBLE_DEVICES": ""})
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_cpu_replicas_share_the_cores() -> None:
    plan = plan_launch(load_settings(device="auto"), 2, "round_robin", [], "k", env={}, gpu_probe=lambda: None)
    threads = {replica.env["OMP_NUM_THREADS"] for replica in plan.replicas}
    assert len(threads) == 1 and int(threads.pop()) >= 1
    assert plan.replica_env["API_KEY"] == "k" and plan.replica_env["ALLOWED_ORIGINS"] == ""
    assert len({replica.port for replica in plan.replicas} | {plan.router_metrics_port}) == 3
    router = plan.router_command()
    assert router[router.index("--policy") + 1] == "round_robin"
    assert router[router.index("--cors-allowed-origins") + 1] == CORS_NOWHERE  # CORS off, as on one server
    assert "--api-key" not in router  # the router would answer /tokenize etc. with its own key: clients' go through
    pinned = plan_launch(load_settings(device="cpu"), 2, "cache_aware", [], None, env={"OMP_NUM_THREADS": "5"})
    # the user's OMP_NUM_THREADS is kept; each replica knows its rank (its KV events' endpoint and stamp)
    assert [replica.env for replica in pinned.replicas] == [{"DATA_PARALLEL_RANK": "0"}, {"DATA_PARALLEL_RANK": "1"}]


def test_kv_event_endpoints_that_ranks_would_share_are_refused_before_launch() -> None:
    def config(endpoint: str, replay: str | None) -> str:
        return json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay})

    clash = load_settings(device="cpu", kv_events_config=config("tcp://*:5557", "tcp://*:5558"))
    with pytest.raises(ConfigurationError, match="rank 1's endpoint \\(tcp://\\*:5558\\) binds the address of rank "
                                                 "0's replay_endpoint"):
        plan_launch(clash, 2, "cache_aware", [], None, env={})
    # one port under other spellings of the wildcard, or a wildcard beside a specific host, is the same bind
    for replay in ("tcp://0.0.0.0:5558", "tcp://127.0.0.1:5558", "tcp://[::]:5558"):
        with pytest.raises(ConfigurationError, match="binds the address of"):
            plan_launch(load_settings(device="cpu", kv_events_config=config("tcp://*:5557", replay)), 2,
                        "cache_aware", [], None, env={})
    with pytest.raises(ConfigurationError, match="port 65536 .*past 65535"):
        plan_launch(load_settings(device="cpu", kv_events_config=config("tcp://*:65535", None)), 2, "cache_aware",
                    [], None, env={})
    # two specific hosts on one port do not overlap; a publisher that connects (not a wildcard) binds nothing
    apart = load_settings(device="cpu", kv_events_config=config("tcp://10.0.0.7:5557", "tcp://127.0.0.1:5558"))
    assert len(plan_launch(apart, 2, "cache_aware", [], None, env={}).replicas) == 2
    with pytest.raises(ConfigurationError, match="rank 1 its own endpoint"):  # ipc cannot be offset
        plan_launch(load_settings(device="cpu", kv_events_config=config("ipc:///tmp/kv", None)), 2, "cache_aware",
                    [], None, env={})
    spaced = load_settings(device="cpu", kv_events_config=config("tcp://*:5557", "tcp://*:5657"))
    assert len(plan_launch(spaced, 4, "cache_aware", [], None, env={}).replicas) == 4
    router = plan_launch(spaced, 2, "cache_aware", [], None, env={}).router_command()
    assert router[router.index("--health-check-timeout-secs") + 1] == "1"  # a hung replica is out within seconds


def test_a_cpu_only_backend_makes_cpu_replicas_whatever_gpus_are_visible() -> None:
    """``BACKEND=custom-cpu`` runs on the CPU: its replicas share the cores instead of taking one GPU each (they got
    CUDA_VISIBLE_DEVICES and no thread cap, and a size above the GPU count was refused)."""
    if not plugin_installed("gemmaserve_custom_torch"):
        pytest.skip("needs the custom_torch plugin's custom-cpu backend")
    plan = plan_launch(load_settings(backend="custom-cpu"), 3, "cache_aware", [], None,
                       env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert [set(replica.env) for replica in plan.replicas] == [{"OMP_NUM_THREADS", "DATA_PARALLEL_RANK"}] * 3


def test_loopback_traffic_bypasses_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's health probes and the router reach the replicas directly although HTTP_PROXY / ALL_PROXY
    point at a proxy that is not there (with one set, no replica ever became ready)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, "http://127.0.0.1:9")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert data_parallel._healthy(f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    env = data_parallel._without_loopback_proxy({"NO_PROXY": "corp.example", "HTTP_PROXY": "http://p:3128"})
    assert env["NO_PROXY"].split(",") == ["corp.example", "127.0.0.1", "localhost", "::1"]
    assert set(env["no_proxy"].split(",")) == {"127.0.0.1", "localhost", "::1"}


class _FakeChild:
    """A replica process stand-in: alive until signalled."""

    def __init__(self, name: str, argv: Any, env: Any, **kwargs: Any) -> None:
        self.name, self.argv, self.pid, self.started = name, list(argv), 4242, time.monotonic()
        self.signals: list[int] = []

    def alive(self) -> bool:
        return not self.signals

    def signal(self, signum: int) -> None:
        self.signals.append(signum)

    def describe_exit(self) -> str:
        return f"{self.name} exited"


def _supervisor(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[tuple[str, str]]]:
    monkeypatch.setattr(data_parallel, "_Child", _FakeChild)
    monkeypatch.setattr(data_parallel._Replica, "_probe", lambda self, child, url: None)  # the test plays it
    supervisor = data_parallel._Supervisor(plan_launch(load_settings(device="cpu"), 2, "cache_aware", [], None,
                                                       env={}))
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(supervisor, "_router_call", lambda action, replica: calls.append((action, replica.plan.url)))
    return supervisor, calls


def test_a_paused_supervisor_does_not_kill_healthy_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liveness counts failed probes, not time since the last success: after the supervisor was stopped for longer
    than the liveness timeout (Ctrl-Z, a frozen container), a replica with no failed probe is left serving (it was
    killed as 'not answering'); one whose probes have failed for longer than the timeout is killed."""
    supervisor, calls = _supervisor(monkeypatch)
    replica = supervisor.replicas[0]
    replica.spawn(supervisor.plan)
    now = time.monotonic()
    replica.state, replica.last_ok = "serving", now - 10 * data_parallel.LIVENESS_TIMEOUT_S  # stale, no failure
    supervisor._tend(replica, now)
    assert replica.child.signals == [] and calls == []
    replica.failing_since = now - data_parallel.LIVENESS_TIMEOUT_S - 1
    supervisor._tend(replica, now)
    assert replica.child.signals == [signal.SIGKILL] and calls == [("remove_worker", replica.plan.url)]


def test_a_restart_moves_off_a_port_taken_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica restarted while another process holds its port gets a free one, and the router is given the new
    address (it kept the launch port and failed every restart: the replica stayed down for good)."""
    import socket

    supervisor, calls = _supervisor(monkeypatch)
    replica = supervisor.replicas[1]
    old = replica.plan.port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", old))
        holder.listen()
        replica.spawn(supervisor.plan)
    argv = replica.child.argv
    assert replica.plan.port != old and argv[argv.index("--port") + 1] == str(replica.plan.port)
    replica.last_ok = time.monotonic()
    supervisor._tend(replica, time.monotonic())
    assert replica.state == "serving" and calls == [("add_worker", f"http://127.0.0.1:{replica.plan.port}")]


def test_replica_flags_leave_out_the_launchers_own() -> None:
    from gemmaserve.cli import _replica_flags, build_parser

    args = build_parser().parse_args([
        "serve", "-dp", "2", "--router-policy", "round_robin", "--host", "0.0.0.0", "--port", "9000",
        "--api-key", "secret", "--model", "/ckpt", "--served-model-name", "a", "b", "--enable-debug-endpoints",
        "--max-batch-size", "4", "--allowed-origins", "*"])
    assert _replica_flags(args) == ["--enable-debug-endpoints", "--served-model-name", "a", "b", "--model=/ckpt",
                                    "--max-batch-size=4"]


# -- two live replicas behind the router -------------------------------------------------------------------
class DataParallelServer:
    """``python -m gemmaserve serve --data-parallel-size N`` in a subprocess on a free loopback port."""

    def __init__(self, env: dict[str, str], workdir: Path, size: int) -> None:
        self.size = size
        self.model: str | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"dp-{self.port}.log"
        self._log = self.log_path.open("w")
        inherited = {key: value for key, value in os.environ.items()
                     if key not in _SETTINGS_ENV and not key.startswith(("GEMMASERVE_", "CUSTOM_BACKEND_"))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gemmaserve", "serve", "--data-parallel-size", str(size), "--host", "127.0.0.1",
             "--port", str(self.port), "--api-key", API_KEY],
            env={**inherited, "DEVICE": "cpu", "DTYPE": "float32", "LOG_LEVEL": "info", **env},
            cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def replicas(self) -> dict[int, tuple[int, int]]:
        """replica index -> (pid, port) of its latest process, from the launcher's log."""
        found: dict[int, tuple[int, int]] = {}
        for match in REPLICA_LOG_LINE.finditer(self.log()):
            found[int(match.group(1))] = (int(match.group(2) or match.group(3)), int(match.group(4)))
        return found

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the launcher exited with {self.process.returncode}:\n{self.log()[-4000:]}")
        try:
            workers = httpx.get(f"{self.url}/workers", timeout=2).json()
        except (httpx.HTTPError, json.JSONDecodeError):
            return False
        return workers["total"] == self.size and all(worker["is_healthy"] for worker in workers["workers"])

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()
        return self.process.returncode


@pytest.fixture(scope="module")
def dp_server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DataParallelServer]:
    if ROUTER_MISSING:
        pytest.skip("vllm-router not installed (pip install 'gemmaserve[router]')")
    server = DataParallelServer({"MODEL": str(chat_checkpoint), "BACKEND": BACKEND}, tmp_path_factory.mktemp("dp"), 2)
    try:
        wait_until(server.ready, STARTUP_S, "both replicas behind the router", interval=0.25)
        yield server
    finally:
        server.stop()


def finished(port: int) -> float:
    samples = parse_prometheus(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    return sum(value for (name, _), value in samples.items() if name == "vllm:e2e_request_latency_seconds_count")


def running(port: int) -> float:
    samples = parse_prometheus(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    return sum(value for (name, _), value in samples.items() if name == "vllm:num_requests_running")


def model_name(server: DataParallelServer) -> str:
    """The served model, through the router (asked once)."""
    if server.model is None:
        response = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10)
        assert response.status_code == 200, response.text
        server.model = str(response.json()["data"][0]["id"])
    return server.model


async def complete(client: httpx.AsyncClient, server: DataParallelServer, prompt: list[int], max_tokens: int,
                   stream: bool = False) -> dict[str, Any]:
    """One completion through the router: ``{"ok", "cached", "error", "ended"}`` (``ended``: monotonic time)."""
    body = {"model": model_name(server), "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    body = {key: value for key, value in body.items() if value is not None}
    result: dict[str, Any] = {"ok": False, "cached": None, "error": None}
    try:
        if not stream:
            response = await client.post(f"{server.url}/v1/completions", json=body, headers=AUTH)
            result["ok"] = response.status_code == 200
            result["error"] = None if result["ok"] else f"HTTP {response.status_code}: {response.text[:200]}"
            if result["ok"]:
                result["cached"] = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        else:
            async with client.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as response:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        result["ok"] = True
                    elif line.startswith("data: {") and json.loads(line[6:]).get("usage"):
                        result["cached"] = json.loads(line[6:])["usage"]["prompt_tokens_details"]["cached_tokens"]
            if not result["ok"]:
                result["error"] = f"HTTP {response.status_code}, no data: [DONE]"
    except httpx.HTTPError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["ended"] = time.monotonic()
    return result


async def until(predicate: Any, timeout: float, what: str) -> Any:
    """:func:`wait_until` for coroutines: polls without blocking the event loop (requests in flight go on)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)
    return value


def prompt(seed: int, length: int = 12) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 400 for i in range(length)]


def test_the_api_key_reaches_the_replicas(dp_server: DataParallelServer) -> None:
    assert httpx.get(f"{dp_server.url}/v1/models", timeout=10).status_code == 401
    body = {"model": model_name(dp_server), "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{dp_server.url}/v1/completions", json=body, timeout=30).status_code == 401
    response = httpx.post(f"{dp_server.url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text  # the router's own fields are accepted (protocol.py)


def test_requests_spread_over_the_replicas(dp_server: DataParallelServer) -> None:
    ports = [port for _, port in dp_server.replicas().values()]
    before = {port: finished(port) for port in ports}

    async def load() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(complete(client, dp_server, prompt(seed), 24) for seed in range(8)))

    results = asyncio.run(load())
    assert all(result["ok"] for result in results), results
    served = {port: finished(port) - before[port] for port in ports}
    assert sum(served.values()) == 8 and all(count > 0 for count in served.values()), served


def test_shared_prefixes_follow_their_cache(dp_server: DataParallelServer) -> None:
    """Two prefix groups, their requests sent in concurrent pairs: cache_aware keeps each group on the replica
    that computed its prefix, so every request after a group's first is a prefix-cache hit."""
    prefixes = [prompt(100 + group, 64) for group in range(2)]

    async def pairs() -> list[list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=60) as client:
            rounds = []
            for turn in range(4):
                rounds.append(await asyncio.gather(*(
                    complete(client, dp_server, prefix + prompt(turn * 10 + group, 8), 4)
                    for group, prefix in enumerate(prefixes))))
            return rounds

    rounds = asyncio.run(pairs())
    assert all(result["ok"] for turn in rounds for result in turn), rounds
    assert all(result["cached"] >= 48 for turn in rounds[1:] for result in turn), rounds


def test_killed_replica_loses_only_its_streams_and_comes_back(dp_server: DataParallelServer) -> None:
    replicas = dp_server.replicas()

    def loads() -> dict[int, float] | None:
        counts = {index: running(port) for index, (_, port) in replicas.items()}
        return counts if sum(counts.values()) == 4 else None

    async def scenario() -> tuple[int, float, list[dict[str, Any]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=90) as client:
            streams = [asyncio.create_task(complete(client, dp_server, prompt(200 + i), 300, stream=True))
                       for i in range(4)]
            counts = await until(loads, 60, "4 streams running")
            victim = max(counts, key=lambda index: counts[index])
            os.kill(replicas[victim][0], signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.sleep(0.3)
            after = await asyncio.gather(*(complete(client, dp_server, prompt(300 + i), 8) for i in range(4)))
            return int(counts[victim]), killed_at, await asyncio.gather(*streams), after

    lost, killed_at, streams, after = asyncio.run(scenario())
    failed = [result for result in streams if not result["ok"]]
    assert len(failed) == lost, streams  # exactly the victim's streams...
    assert all(result["ended"] - killed_at < 10 for result in failed), streams  # ...and they end at once
    assert all(result["ok"] for result in after), after  # new requests go to the live replica
    # the restarted replica is added back and serves again
    restarted = wait_until(lambda: next((pid for index, (pid, _) in dp_server.replicas().items()
                                         if pid != replicas[index][0]), None), 30, "the launcher to restart it")
    wait_until(dp_server.ready, STARTUP_S, "the restarted replica back behind the router", interval=0.25)
    assert time.monotonic() - killed_at < STARTUP_S
    (index,) = [index for index, (pid, _) in dp_server.replicas().items() if pid == restarted]
    port = dp_server.replicas()[index][1]
    before = finished(port)

    async def load() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(complete(client, dp_server, prompt(400 + seed), 16) for seed in range(6)))

    assert all(result["ok"] for result in asyncio.run(load()))
    assert finished(port) > before, "the restarted replica got no request"


def test_sigterm_drains_and_exits_zero(dp_server: DataParallelServer) -> None:
    """Last: a running stream completes after SIGTERM, a late request gets a clean 503, every child exits."""
    pids = [pid for pid, _ in dp_server.replicas().values()]

    async def drain() -> tuple[dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            stream = asyncio.create_task(complete(client, dp_server, prompt(500), 60, stream=True))
            await until(lambda: sum(running(port) for _, port in dp_server.replicas().values()) == 1, 30, "the stream")
            dp_server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            late = await complete(client, dp_server, prompt(501), 4)
            return await stream, late

    stream, late = asyncio.run(drain())
    assert stream["ok"], stream
    assert not late["ok"] and late["error"].startswith("HTTP 503"), late
    assert dp_server.process.wait(timeout=40) == 0, dp_server.log()[-3000:]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
