"""Running a test script under the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before triton is
imported, so the script runs in a fresh interpreter process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_interpreted(script: str, *args: str, timeout: float = 600) -> Any:
    """Run ``script`` (with ``args``) in a subprocess under ``TRITON_INTERPRET=1`` on one CPU thread and return the
    JSON of its last stdout line; the script's stderr tail is the assertion message if it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
