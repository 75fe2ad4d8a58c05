"""The example third-party plugin (tests/plugins/gemmaserve_toy_backend) is pip-installed into a
scratch directory, discovered through its entry point, selected with BACKEND=toy and driven
through the scheduler by the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_DIR = Path(__file__).parent / "plugins" / "gemmaserve_toy_backend"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("toy_site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(PLUGIN_DIR)],
        check=True,
        capture_output=True,
    )
    return target


def _run(plugin_site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(plugin_site), **env}
    full_env.pop("BACKEND", None)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "gemmaserve", *args], capture_output=True, text=True, env=full_env, timeout=300
    )


def test_toy_plugin_is_discovered(plugin_site: Path) -> None:
    result = _run(plugin_site, "backends")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("toy "))
    assert "toy" in line and "yes" in line


def test_toy_plugin_generates_through_the_scheduler(plugin_site: Path) -> None:
    result = _run(plugin_site, "generate", "Hello", "--max-tokens", "12", "--ignore-eos", BACKEND="toy", DEVICE="cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "12 tokens" in lines[-1] and "cached tokens: 0" in lines[-1]
    assert len(lines[0]) == 12  # one printable character per toy token
