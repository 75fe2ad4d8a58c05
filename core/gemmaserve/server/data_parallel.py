"""``gemmaserve serve --data-parallel-size N``: N ``gemmaserve serve`` replicas behind vllm-router.

This process is a supervisor. It starts N replicas on free loopback ports (one GPU each via
``CUDA_VISIBLE_DEVICES`` on CUDA, else N replicas sharing the CPU), waits until every one answers ``/health``,
then starts vllm-router (the ``vllm-router`` package from PyPI) on the public ``--host`` / ``--port`` with the
replicas' URLs and the chosen policy. It serves nothing itself. While running:

* a replica that exits is taken out of the router at once (``/remove_worker``) and restarted with backoff
  (1, 2, 4, 8, 16 s; after :data:`MAX_RESTARTS` restarts within :data:`RESTART_WINDOW_S` it stays down); a
  restarted replica is added back (``/add_worker``) once healthy. One whose ``/health`` has failed for
  :data:`LIVENESS_TIMEOUT_S` is killed and restarted the same way. The router's own health checks (every
  :data:`ROUTER_HEALTH_INTERVAL_S` s) take out a replica that stops answering in the meantime;
* SIGTERM / SIGINT: every replica is sent SIGTERM (each drains for ``--shutdown-timeout``, as ``gemmaserve
  serve`` does) while the router keeps carrying their responses; then the router is stopped. A second signal
  is forwarded, so the replicas cancel what still runs at once;
* a replica that fails before the router started, or the router exiting, ends the launcher with
  :class:`DataParallelError` (a non-zero exit) naming the process and the end of its output.

Children get ``PR_SET_PDEATHSIG`` (Linux): they are sent SIGTERM if the launcher dies.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

from gemmaserve.errors import ConfigurationError, GemmaserveError
from gemmaserve.kv.events import check_rank_endpoints
from gemmaserve.settings import CoreSettings, split_list

__all__ = [
    "REPLICA_LOG_LINE",
    "ROUTER_DISTRIBUTION",
    "ROUTER_POLICIES",
    "DataParallelError",
    "LaunchPlan",
    "ReplicaPlan",
    "plan_launch",
    "require_router",
    "serve_data_parallel",
    "visible_gpus",
]

REPLICA_LOG_LINE = re.compile(
    r"replica (\d+) (?:\(pid (\d+)\) starting|restarted \(pid (\d+)\)) on http://127\.0\.0\.1:(\d+)")
"""The launcher's log line for a replica process (re)started: index, pid (starting or restarted), port. Tests
and benchmarks/data_parallel.py read the replicas from the log with it."""

logger = logging.getLogger(__name__)

ROUTER_DISTRIBUTION = "vllm-router"
"""The PyPI package of the router (``pip install 'gemmaserve[router]'`` installs it)."""
ROUTER_MODULES = ("vllm_router", "vllm_router_rs")
"""Its Python launcher and its compiled router, both needed."""
ROUTER_POLICIES = ("cache_aware", "round_robin")
"""The router's policies offered here: ``--router-policy`` (default cache_aware)."""
REPLICA_HOST = "127.0.0.1"
CORS_NOWHERE = "http://cors-disabled.invalid"
"""The router answers CORS for any origin when given none; this origin (``.invalid`` never resolves, RFC 2606)
is what it gets for "CORS off", so no real page is allowed."""

REPLICA_KEEP_ALIVE_S = 120.0
"""Replicas keep the router's idle connections this long: longer than the router's connection pool keeps them
(reqwest's default is 90 s), so the router, not the replica, closes an idle connection (no reuse of a just-closed one)."""
ROUTER_HEALTH_INTERVAL_S = 2
ROUTER_HEALTH_FAILURES = 2
ROUTER_HEALTH_TIMEOUT_S = 1
"""A replica's /health answers in milliseconds (the event loop never waits on the engine); the router's default 5 s
timeout made each failed check take 7 s, so a hung replica kept receiving requests for 8-12 s."""
"""The router's health checks: a replica failing ``/health`` this many times in a row, this often, is out."""
STARTUP_TIMEOUT_S = 1800.0
"""How long a replica may take to answer ``/health`` after it was started (big checkpoints load slowly)."""
ROUTER_STARTUP_TIMEOUT_S = 60.0
LIVENESS_TIMEOUT_S = 60.0
"""A serving replica whose ``/health`` has failed this long (e.g. its engine loop died) is killed and restarted."""
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
MAX_BACKOFF_S = 16.0
STOP_GRACE_S = 13.0
"""After ``--shutdown-timeout``, how much longer a draining replica may take to exit before it is killed
(``gemmaserve serve`` gives cancelled requests 3 s to send their errors, then closes the engine)."""
LOG_TAIL_LINES = 40
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ROUTER_STARTUP_CHATTER = re.compile(r"DEBUG: ")
"""Lines the router prints at start whatever its log level ("DEBUG: Creating HTTP client"...)."""
_ROUTER_LOG_LEVEL = {"debug": "debug", "info": "warning", "warning": "warning", "error": "error"}
"""gemmaserve's level -> the router's: at info the router logs two lines per request, so it logs warnings."""


class DataParallelError(GemmaserveError):
    """A replica could not start, or the router failed: the launcher stops everything and exits non-zero."""


# -- planning (no processes) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaPlan:
    """One replica: its loopback port and its own environment on top of the shared one."""

    index: int
    port: int
    env: Mapping[str, str]

    @property
    def url(self) -> str:
        return f"http://{REPLICA_HOST}:{self.port}"

    def where(self) -> str:
        if "CUDA_VISIBLE_DEVICES" in self.env:
            return f"GPU {self.env['CUDA_VISIBLE_DEVICES']}"
        return f"CPU, {self.env.get('OMP_NUM_THREADS', 'default')} threads"


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the supervisor runs: the replicas' command and env, and the router's command."""

    host: str
    port: int
    policy: str
    replica_argv: tuple[str, ...]
    """``gemmaserve serve`` flags for every replica (without --host / --port)."""
    replica_env: Mapping[str, str]
    """Set for every replica on top of this process's environment."""
    replicas: tuple[ReplicaPlan, ...]
    router_metrics_port: int
    allowed_origins: tuple[str, ...]
    log_level: str
    shutdown_timeout: float

    def replica_command(self, replica: ReplicaPlan) -> list[str]:
        return [sys.executable, "-m", "gemmaserve", "serve", *self.replica_argv,
                "--host", REPLICA_HOST, "--port", str(replica.port)]

    def router_command(self) -> list[str]:
        """vllm-router on the public address, the replicas as workers; retries and circuit breaker at the
        router's defaults. The router gets no API key: the clients' ``Authorization`` reaches the replicas."""
        if "*" in self.allowed_origins:
            cors: list[str] = []  # the router's default: any origin
        else:
            cors = ["--cors-allowed-origins", *(self.allowed_origins or (CORS_NOWHERE,))]
        return [
            sys.executable, "-m", "vllm_router.launch_router",
            "--host", self.host, "--port", str(self.port),
            "--worker-urls", *(replica.url for replica in self.replicas),
            "--policy", self.policy,
            "--prometheus-host", REPLICA_HOST, "--prometheus-port", str(self.router_metrics_port),
            "--health-check-interval-secs", str(ROUTER_HEALTH_INTERVAL_S),
            "--health-check-timeout-secs", str(ROUTER_HEALTH_TIMEOUT_S),
            "--health-failure-threshold", str(ROUTER_HEALTH_FAILURES), "--health-success-threshold", "1",
            "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", str(int(ROUTER_STARTUP_TIMEOUT_S)),
            "--log-level", _ROUTER_LOG_LEVEL[self.log_level],
            *cors,
        ]

    @property
    def public_url(self) -> str:
        return f"http://{_probe_host(self.host)}:{self.port}"


def require_router() -> None:
    """ConfigurationError naming the package to install unless vllm-router is importable here."""
    missing = [name for name in ROUTER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigurationError(
            f"--data-parallel-size > 1 puts the replicas behind vllm-router, which is not installed here (no module "
            f"{missing[0]!r}): pip install 'gemmaserve[router]' (the {ROUTER_DISTRIBUTION} package; wheels exist for "
            "Linux x86_64 and aarch64)")


def visible_gpus(env: Mapping[str, str], probe: Callable[[], int | None] | None = None) -> list[str] | None:
    """The CUDA devices replicas can be pinned to, as ``CUDA_VISIBLE_DEVICES`` entries: the entries of that
    variable when it is set (empty or ``-1``: none), else ``nvidia-smi``'s GPU indices, else the count of
    ``probe`` (default: torch in a subprocess, when installed). None when nothing tells (no CUDA here)."""
    declared = env.get("CUDA_VISIBLE_DEVICES")
    if declared is not None:
        entries = [entry.strip() for entry in declared.split(",") if entry.strip()]
        return [] if not entries or entries[0] == "-1" else entries
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.split()
        if listed:
            return listed
    count = (probe or _torch_gpu_count)()
    return None if count is None else [str(index) for index in range(count)]


def _torch_gpu_count() -> int | None:
    """torch.cuda.device_count() from a subprocess (this process never imports torch); None without torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        return int(out.strip().splitlines()[-1])
    return None


_EDGE_SETTINGS = {
    "allowed_hosts": "--allowed-hosts (ALLOWED_HOSTS): the router forwards requests with the replica's own Host and "
                     "checks none itself",
    "timeout_keep_alive": "--timeout-keep-alive (TIMEOUT_KEEP_ALIVE): clients keep their connections to the router, "
                          "whose keep-alive is its own",
    "client_header_timeout": "--client-header-timeout (CLIENT_HEADER_TIMEOUT): clients send their requests to the "
                             "router, not to the replicas",
    "client_body_timeout": "--client-body-timeout (CLIENT_BODY_TIMEOUT): clients send their requests to the router, "
                           "not to the replicas",
    "allowed_headers": "--allowed-headers (ALLOWED_HEADERS): the router answers CORS with its own allowances (only "
                       "--allowed-origins reaches it)",
    "allowed_methods": "--allowed-methods (ALLOWED_METHODS): the router answers CORS with its own allowances (only "
                       "--allowed-origins reaches it)",
    "allow_credentials": "--allow-credentials (ALLOW_CREDENTIALS): the router answers CORS with its own allowances "
                         "(only --allowed-origins reaches it)",
}
"""Client-facing settings of one server that mean nothing behind the router: refused when set."""


def plan_launch(settings: CoreSettings, size: int, policy: str, replica_flags: Sequence[str],
                api_key: str | None, env: Mapping[str, str] | None = None,
                gpu_probe: Callable[[], int | None] | None = None) -> LaunchPlan:
    """The launch of ``size`` replicas of ``settings`` behind the router with ``policy``. ``replica_flags`` are the
    ``gemmaserve serve`` flags every replica gets; ``api_key`` (``--api-key``) reaches them through their env.
    Raises ConfigurationError for a size, policy, device or setting this mode cannot honour."""
    env = os.environ if env is None else env
    if size < 2:
        raise ConfigurationError(f"--data-parallel-size {size}: the launcher runs 2 or more replicas (1 is the "
                                 "plain single-process server)")
    if policy not in ROUTER_POLICIES:
        raise ConfigurationError(f"--router-policy {policy!r}: choose one of {', '.join(ROUTER_POLICIES)}")
    if settings.port == 0:
        raise ConfigurationError("--port 0 (any free port) cannot be used with --data-parallel-size: the router "
                                 "needs a known port; give one")
    for name, why in _EDGE_SETTINGS.items():
        if getattr(settings, name) != CoreSettings.model_fields[name].default:
            raise ConfigurationError(f"{why}; unset it with --data-parallel-size {size}")
    check_rank_endpoints(settings.kv_events_config, size)  # before any replica loads its model
    per_replica = _replica_envs(_replica_device(settings), size, env, gpu_probe)
    ports = _free_ports(size + 1)
    shared_env = {
        "ALLOWED_ORIGINS": "",  # CORS is answered by the router (its --cors-allowed-origins)
        **({"API_KEY": api_key} if api_key is not None else {}),
    }
    flags = (*replica_flags, "--timeout-keep-alive", str(REPLICA_KEEP_ALIVE_S))
    replicas = tuple(ReplicaPlan(index, port, {**extra, "DATA_PARALLEL_RANK": str(index)})
                     for index, (port, extra) in enumerate(zip(ports, per_replica)))
    origins = tuple(split_list(settings.allowed_origins, "ALLOWED_ORIGINS"))
    return LaunchPlan(host=settings.host, port=settings.port, policy=policy, replica_argv=flags, replica_env=shared_env,
                      replicas=replicas, router_metrics_port=ports[-1], allowed_origins=origins,
                      log_level=settings.log_level, shutdown_timeout=settings.shutdown_timeout)


def _replica_device(settings: CoreSettings) -> str:
    """The device the replicas run on as far as the settings decide it: ``DEVICE``, except that a backend named by
    ``BACKEND`` that runs on no GPU (``custom-cpu``) makes CPU replicas whatever ``DEVICE`` says."""
    if settings.backend == "auto" or settings.device == "cpu":
        return settings.device
    from gemmaserve.plugins import load_registry

    spec = load_registry().get(settings.backend)
    return "cpu" if spec is not None and "cuda" not in spec.devices else settings.device


def _replica_envs(device: str, size: int, env: Mapping[str, str],
                  gpu_probe: Callable[[], int | None] | None) -> list[dict[str, str]]:
    """Per replica: ``CUDA_VISIBLE_DEVICES`` (one GPU each) on cuda, or on auto where GPUs are visible; else the
    CPU split into equal ``OMP_NUM_THREADS`` shares (unless that variable is set)."""
    if device in ("cuda", "auto"):
        gpus = visible_gpus(env, gpu_probe)
        if gpus:
            if size > len(gpus):
                raise ConfigurationError(
                    f"--data-parallel-size {size} runs one replica per GPU, but {len(gpus)} GPU(s) are visible "
                    f"({', '.join(gpus)}); lower the size, or use --device cpu for CPU replicas")
            return [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in gpus[:size]]
        if device == "cuda":
            raise ConfigurationError("--device cuda with --data-parallel-size: no CUDA GPU is visible "
                                     "(CUDA_VISIBLE_DEVICES, nvidia-smi and torch found none)")
    if "OMP_NUM_THREADS" in env:
        return [{} for _ in range(size)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return [{"OMP_NUM_THREADS": str(max(1, cores // size))} for _ in range(size)]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on the loopback address right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((REPLICA_HOST, 0))
            sockets.append(sock)
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _probe_host(host: str) -> str:
    """Where this machine reaches a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


# -- processes -------------------------------------------------------------------------------------------
def _death_signal() -> Callable[[], None] | None:
    """A preexec function giving the child SIGTERM when this process dies (Linux prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


class _Child:
    """A child process in its own session (a terminal's Ctrl-C reaches only the launcher, which forwards one
    SIGTERM), its output copied to stderr line by line with ``[name]`` in front; the last lines are kept."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str],
                 drop: re.Pattern[str] | None = None) -> None:
        self.name = name
        self._drop = drop
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.started = time.monotonic()
        self.process = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_death_signal())
        self._copier = threading.Thread(target=self._copy, name=f"{name}-output", daemon=True)
        self._copier.start()

    def _copy(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = _ANSI.sub("", raw.decode(errors="replace")).rstrip()
            if self._drop is not None and self._drop.match(line):
                continue
            self.tail.append(line)
            sys.stderr.write(f"[{self.name}] {line}\n")
            sys.stderr.flush()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        """Whether it exited within ``timeout`` s (its output is copied out before this returns)."""
        try:
            self.process.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return False
        self._copier.join(timeout=2)
        return True

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` s."""
        if self.alive():
            self.signal(signal.SIGTERM)
            if not self.wait(grace):
                self.signal(signal.SIGKILL)
                self.wait(10)

    def describe_exit(self) -> str:
        code = self.process.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        output = "\n".join(f"  {line}" for line in self.tail) or "  (no output)"
        return f"{self.name} (pid {self.pid}) {how}; its last output:\n{output}"


def _healthy(url: str, timeout: float = 2.0) -> bool:
    import httpx

    try:  # trust_env=False: loopback traffic never goes through HTTP_PROXY / ALL_PROXY
        return httpx.get(f"{url}/health", timeout=timeout, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def _without_loopback_proxy(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the loopback names added to ``NO_PROXY`` / ``no_proxy``, so the router reaches its replicas
    directly even where ``HTTP_PROXY`` / ``ALL_PROXY`` are set."""
    out = dict(env)
    for name in ("NO_PROXY", "no_proxy"):
        entries = [entry for entry in out.get(name, "").split(",") if entry.strip()]
        out[name] = ",".join([*entries, *(host for host in _LOOPBACK_NAMES if host not in entries)])
    return out


def _port_free(port: int) -> bool:
    """True if ``port`` can be bound on the loopback address right now (as the replica's server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((REPLICA_HOST, port))
        except OSError:
            return False
    return True


class _Replica:
    """One replica's process across restarts; a daemon thread probes its /health: ``last_ok`` is its latest
    healthy answer, ``failing_since`` the first of the failed probes since then (None while it answers). Liveness
    is judged by failed probes, not by time since a success: a supervisor that was paused (Ctrl-Z, a frozen
    container) has a stale ``last_ok`` but no failures, and must not kill healthy replicas. ``plan.port`` may
    change across restarts (a port taken meanwhile)."""

    def __init__(self, plan: ReplicaPlan) -> None:
        self.plan = plan
        self.name = f"replica {plan.index}"
        self.child: _Child | None = None
        self.state = "down"  # down -> starting -> serving -> down ...; failed: given up
        self.last_ok = 0.0
        self.failing_since: float | None = None
        self.restart_at = 0.0
        self.restarts: list[float] = []

    def spawn(self, launch: LaunchPlan) -> None:
        if not _port_free(self.plan.port):  # taken since the launch picked it: the replica could never bind it
            port = _free_ports(1)[0]
            logger.warning("%s: port %d is taken now; the replica moves to port %d", self.name, self.plan.port, port)
            self.plan = replace(self.plan, port=port)
        env = {**os.environ, **launch.replica_env, **self.plan.env}
        self.child = _Child(self.name, launch.replica_command(self.plan), env)
        self.state, self.last_ok, self.failing_since = "starting", 0.0, None
        threading.Thread(target=self._probe, args=(self.child, self.plan.url), name=f"{self.name}-health",
                         daemon=True).start()

    def _probe(self, child: _Child, url: str) -> None:
        while child.alive():
            if _healthy(url, timeout=5.0 if self.state == "serving" else 2.0):
                self.last_ok, self.failing_since = time.monotonic(), None
            elif self.failing_since is None:
                self.failing_since = time.monotonic()
            time.sleep(2.0 if self.state == "serving" else 0.25)


class _Supervisor:
    """Runs a :class:`LaunchPlan` until a signal or a fatal failure (see the module docstring)."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.replicas = [_Replica(replica) for replica in plan.replicas]
        self.router: _Child | None = None
        self.signals = 0

    # signals (handled in the main thread, between two steps of the loop): count, and forward a second one;
    # the loop notices ``signals`` and shuts down
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        if self.signals > 1:
            logger.warning("second signal: the replicas cancel their running requests now")
            for replica in self.replicas:
                if replica.child is not None:
                    replica.child.signal(signal.SIGTERM)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if self._start() and not self.signals:
                self._supervise()
            return 0
        finally:
            self._shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> bool:
        """Every replica healthy, then the router ready; False if a signal came first. Raises DataParallelError."""
        for replica in self.replicas:
            replica.spawn(self.plan)
            assert replica.child is not None
            logger.info("%s (pid %d) starting on %s (%s)", replica.name, replica.child.pid, replica.plan.url,
                        replica.plan.where())
        while not self.signals:
            for replica in self.replicas:
                assert replica.child is not None
                if not replica.child.alive():
                    raise DataParallelError(f"{replica.child.describe_exit()}\nno replica is restarted before all "
                                            "of them have started once: fix the cause and start again")
                if replica.state == "starting" and replica.last_ok:
                    replica.state = "serving"
                    logger.info("%s (pid %d) ready on %s", replica.name, replica.child.pid, replica.plan.url)
                if time.monotonic() - replica.child.started > STARTUP_TIMEOUT_S and replica.state == "starting":
                    raise DataParallelError(f"{replica.name} did not answer /health within {STARTUP_TIMEOUT_S:g} s")
            if all(replica.state == "serving" for replica in self.replicas):
                break
            time.sleep(0.1)
        if self.signals:
            return False
        quiet = None if self.plan.log_level == "debug" else _ROUTER_STARTUP_CHATTER
        self.router = _Child("router", self.plan.router_command(), _without_loopback_proxy(os.environ), drop=quiet)
        deadline = time.monotonic() + ROUTER_STARTUP_TIMEOUT_S
        while not self.signals:
            if not self.router.alive():
                raise DataParallelError(self.router.describe_exit())
            if _healthy(self.plan.public_url):
                break
            if time.monotonic() > deadline:
                raise DataParallelError(f"the router did not answer {self.plan.public_url}/health within "
                                        f"{ROUTER_STARTUP_TIMEOUT_S:g} s")
            time.sleep(0.1)
        logger.info("serving on http://%s:%d: %d replicas behind vllm-router (policy %s; router metrics on "
                    "http://%s:%d/metrics)", self.plan.host, self.plan.port, len(self.replicas), self.plan.policy,
                    REPLICA_HOST, self.plan.router_metrics_port)
        return not self.signals

    def _supervise(self) -> None:
        """Until a signal: restart replicas that exit or stop answering; the router's death is fatal."""
        while not self.signals:
            assert self.router is not None
            if not self.router.alive():
                raise DataParallelError(f"{self.router.describe_exit()}\nthe replicas are stopped")
            now = time.monotonic()
            for replica in self.replicas:
                self._tend(replica, now)
            if all(replica.state == "failed" for replica in self.replicas):
                raise DataParallelError("every replica failed too often; see their output above")
            time.sleep(0.1)

    def _tend(self, replica: _Replica, now: float) -> None:
        child = replica.child
        if replica.state == "starting":
            assert child is not None
            if not child.alive():
                logger.error("%s", child.describe_exit())
                self._schedule_restart(replica, now)
            elif replica.last_ok:
                replica.state = "serving"
                self._router_call("add_worker", replica)
                logger.info("%s (pid %d) is back on %s", replica.name, child.pid, replica.plan.url)
            elif now - child.started > STARTUP_TIMEOUT_S:
                logger.error("%s did not answer /health within %g s: killing it", replica.name, STARTUP_TIMEOUT_S)
                child.signal(signal.SIGKILL)
        elif replica.state == "serving":
            assert child is not None
            if not child.alive():
                self._router_call("remove_worker", replica)
                logger.error("%s", child.describe_exit())
                self._schedule_restart(replica, now)
            elif replica.failing_since is not None and now - replica.failing_since > LIVENESS_TIMEOUT_S:
                logger.error("%s has not answered /health for %g s: killing it", replica.name, LIVENESS_TIMEOUT_S)
                self._router_call("remove_worker", replica)
                child.signal(signal.SIGKILL)
                replica.failing_since = None  # its exit is handled on a later pass
        elif replica.state == "down" and now >= replica.restart_at:
            replica.spawn(self.plan)
            assert replica.child is not None
            logger.info("%s restarted (pid %d) on %s", replica.name, replica.child.pid, replica.plan.url)

    def _schedule_restart(self, replica: _Replica, now: float) -> None:
        replica.restarts = [t for t in replica.restarts if now - t < RESTART_WINDOW_S]
        if len(replica.restarts) >= MAX_RESTARTS:
            replica.state = "failed"
            logger.error("%s failed %d times within %g s: it stays down (the others go on serving)", replica.name,
                         MAX_RESTARTS + 1, RESTART_WINDOW_S)
            return
        delay = min(MAX_BACKOFF_S, 2.0 ** len(replica.restarts))
        replica.restarts.append(now)
        replica.state, replica.restart_at = "down", now + delay
        logger.warning("%s restarts in %g s", replica.name, delay)

    def _router_call(self, action: str, replica: _Replica) -> None:
        """POST /add_worker or /remove_worker to the router; a failure is logged (its health checks remain)."""
        import httpx

        url = f"{self.plan.public_url}/{action}?url={quote(replica.plan.url, safe='')}"
        try:
            response = httpx.post(url, timeout=5.0, trust_env=False)
            if response.status_code >= 400:
                logger.warning("router %s %s: HTTP %d %s", action, replica.plan.url, response.status_code,
                               response.text[:200])
        except httpx.HTTPError as exc:
            logger.warning("router %s %s failed: %s", action, replica.plan.url, exc)

    def _shutdown(self) -> None:
        """Drain: take every replica out of the router (new requests get its 503 "No available workers" rather
        than a refused connection's 500), SIGTERM them, wait (``--shutdown-timeout`` plus grace), stop the router."""
        if self.router is not None and self.router.alive():
            for replica in self.replicas:
                if replica.state == "serving":
                    self._router_call("remove_worker", replica)
        running = [replica.child for replica in self.replicas if replica.child is not None and replica.child.alive()]
        for child in running:
            child.signal(signal.SIGTERM)
        if running:
            logger.info("stopping %d replica(s): draining for up to %g s", len(running), self.plan.shutdown_timeout)
        deadline = time.monotonic() + self.plan.shutdown_timeout + STOP_GRACE_S
        for child in running:
            if not child.wait(deadline - time.monotonic()):
                logger.warning("%s did not exit in time: killing it", child.name)
                child.signal(signal.SIGKILL)
                child.wait(10)
        if self.router is not None:
            self.router.stop(grace=10)


def serve_data_parallel(settings: CoreSettings, size: int, policy: str, replica_flags: Sequence[str],
                        api_key: str | None = None) -> int:
    """Blocking: run ``size`` replicas behind the router until SIGTERM / SIGINT; returns 0 after a drain.
    Raises ConfigurationError (bad launch, router not installed) before starting anything, DataParallelError
    when a replica cannot start or the router fails."""
    require_router()
    check_public_address(settings)
    plan = plan_launch(settings, size, policy, replica_flags, api_key)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health probe
    return _Supervisor(plan).run()


def check_public_address(settings: CoreSettings) -> None:
    """Raise ConfigurationError (``cannot listen on HOST:PORT: ...``) at once when the router could not bind the
    public ``--host`` / ``--port`` (in use, not an address of this machine), instead of after every replica has
    loaded its model. A test bind, closed again before the router binds it."""
    from gemmaserve.server.serve import bind_listeners

    for sock in bind_listeners(settings.host, settings.port):
        sock.close()
