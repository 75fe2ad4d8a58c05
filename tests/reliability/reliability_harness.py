"""Shared by the reliability tests and the load-test command: live servers (reusing
``tests/server/server_harness.py``), the fault-injecting plugin, KV-leak checks through
``/debug/kv`` and ``/metrics``, the server's RSS, and an async streaming client."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

__all__ = [
    "FAULT_PLUGIN_DIR",
    "POISON",
    "LiveServer",
    "StreamResult",
    "assert_no_leaks",
    "build_chat_checkpoint",
    "install_fault_plugin",
    "kv_figures",
    "metric",
    "post_json",
    "require_custom_torch",
    "rss_kib",
    "scrape",
    "sse_events",
    "stream_completion",
    "wait_idle",
    "wait_until",
    "with_pythonpath",
]

_TESTS = Path(__file__).resolve().parents[1]
FAULT_PLUGIN_DIR = _TESTS / "plugins" / "gemmaserve_fault_backend"
POISON = (3, 2, 3, 2)
"""The fault plugin's poison sequence in these tests (special-token ids a model never emits in a row)."""


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_server = _load("gemmaserve_tests_reliability_server_harness", _TESTS / "server" / "server_harness.py")
LiveServer = _server.LiveServer
build_chat_checkpoint = _server.build_chat_checkpoint
metric = _server.metric
wait_until = _server.wait_until
sse_events = _server.sse_events
parse_prometheus = _server.parse_prometheus


def require_custom_torch() -> None:
    """Skip the calling test unless torch and the custom_torch plugin are installed."""
    import pytest

    pytest.importorskip("torch")
    pytest.importorskip("gemmaserve_custom_torch", reason="the custom_torch plugin is not installed")


def install_fault_plugin(target: Path) -> Path:
    """pip-install the fault plugin into ``target`` (no deps) and return it, for PYTHONPATH."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(FAULT_PLUGIN_DIR)],
        check=True, capture_output=True,
    )
    return target


def with_pythonpath(env: dict[str, str], *paths: Path) -> dict[str, str]:
    """``env`` plus PYTHONPATH = ``paths`` + the current PYTHONPATH."""
    parts = [str(p) for p in paths] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(parts)}


# -- server state -------------------------------------------------------------------------------------
def scrape(base_url: str) -> dict[Any, float]:
    return parse_prometheus(httpx.get(f"{base_url}/metrics", timeout=60).text)


def kv_report(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/debug/kv", timeout=60).json()


def kv_figures(base_url: str) -> dict[str, Any]:
    """Leak figures from both ``/debug/kv`` and ``/metrics``. ``leaked_blocks`` = blocks in use that
    the prefix cache does not hold (the custom backends' ``blocks_used`` minus ``*_blocks_cached``;
    the core prefix cache's pinned blocks for the others); 0 once nothing runs."""
    report = kv_report(base_url)
    samples = scrape(base_url)
    kv = report["kv"]
    cached_keys = [key for key in kv if key.endswith("_blocks_cached")]
    if "blocks_used" in kv and cached_keys:
        leaked = kv["blocks_used"] - sum(kv[key] for key in cached_keys)
        cached_metric = sum(metric(samples, "gemmaserve_backend_kv", stat=key) for key in cached_keys)
        leaked_metric = metric(samples, "gemmaserve_kv_blocks_used") - cached_metric
    else:
        cache = report["prefix_cache"] or {}
        leaked = cache.get("pinned_blocks", 0)
        leaked_metric = metric(samples, "gemmaserve_prefix_cache_blocks", state="pinned")
    return {
        "integrity": report["integrity"],
        "running": report["running"],
        "waiting": report["waiting"],
        "live_rows": report["live_rows"],
        "reservations": kv.get("reservations", 0),
        "reserved_tokens": kv.get("reserved_tokens", kv.get("tokens_reserved", 0)),
        "leaked_blocks": leaked,
        "leaked_blocks_metrics": int(leaked_metric),
        "running_metrics": int(metric(samples, "gemmaserve_num_requests_running")),
        "waiting_metrics": int(metric(samples, "gemmaserve_num_requests_waiting")),
        "blocks_used": kv.get("blocks_used"),
        "finished": report["finished"],
    }


def wait_idle(base_url: str, timeout: float = 60) -> dict[str, Any]:
    """Wait until nothing runs or waits and no row KV is alive; returns :func:`kv_figures`."""
    def idle() -> dict[str, Any] | None:
        figures = kv_figures(base_url)
        quiet = figures["running"] == figures["waiting"] == 0 and not figures["live_rows"]
        return figures if quiet else None

    return wait_until(idle, timeout, f"{base_url} to go idle")


def assert_no_leaks(base_url: str, timeout: float = 60) -> dict[str, Any]:
    """Once idle: integrity ok, no live rows, reservations or leaked blocks (by /debug/kv and /metrics)."""
    figures = wait_idle(base_url, timeout)
    assert figures["integrity"] == "ok", figures
    assert figures["reservations"] == 0 and figures["reserved_tokens"] == 0, figures
    assert figures["leaked_blocks"] == 0 and figures["leaked_blocks_metrics"] == 0, figures
    assert figures["running_metrics"] == figures["waiting_metrics"] == 0, figures
    return figures


def rss_kib(pid: int) -> int:
    """The process's resident set size (``VmRSS`` in /proc/<pid>/status), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- clients ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class StreamResult:
    """One streamed request as the client saw it. ``error`` is the error body (HTTP error, or the
    in-band SSE error); ``done`` means ``data: [DONE]`` arrived."""

    status: int
    text: str = ""
    chunks: int = 0
    ttft: float | None = None
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    disconnected: bool = False
    retry_after: str | None = None


def _choice_text(payload: dict[str, Any]) -> str:
    choice = payload["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def stream_completion(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], *, disconnect_after: int | None = None
) -> StreamResult:
    """POST ``body`` with ``stream: true`` and read the SSE reply. With ``disconnect_after=n`` the
    connection is closed after ``n`` chunks carrying choices (mid-stream disconnect)."""
    start = time.monotonic()
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        result = StreamResult(response.status_code, retry_after=response.headers.get("retry-after"))
        if response.status_code != 200:
            raw = await response.aread()
            result.error = json.loads(raw)["error"]
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                break
            payload = json.loads(data)
            if "error" in payload:
                result.error = payload["error"]
                continue
            if not payload.get("choices"):
                continue
            text = _choice_text(payload)
            if result.ttft is None and (text or payload["choices"][0].get("finish_reason")):
                result.ttft = time.monotonic() - start
            result.text += text
            result.chunks += 1
            result.finish_reason = payload["choices"][0].get("finish_reason") or result.finish_reason
            if disconnect_after is not None and result.chunks >= disconnect_after:
                result.disconnected = True
                break
    return result


async def post_json(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Non-streamed POST; returns (status, JSON body)."""
    response = await client.post(path, json={**body, "stream": False})
    return response.status_code, response.json()


def response_text(path: str, payload: dict[str, Any]) -> str:
    """The generated text of a non-streamed completions or chat response."""
    choice = payload["choices"][0]
    return choice["message"]["content"] if "chat" in path else choice["text"]
