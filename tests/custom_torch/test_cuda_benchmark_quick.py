"""The decode benchmark's ``--quick`` smoke run (tiny shapes, CPU) end to end: every section runs through the
real Engine and the JSON holds sane numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode.py"


def test_decode_benchmark_quick_runs_end_to_end(tmp_path):
    out = tmp_path / "quick.json"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--long-sizes", "12",
                           "--long-prompt-len", "40", "--long-output-len", "4", "--serving-rates", "40",
                           "--serving-requests", "6"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["meta"]["quick"] and results["meta"]["config"] == "tiny"
    rows = results["workload_a"]
    assert [row["N"] for row in rows] == [1, 2]
    for row in rows + results["hf"]:
        assert not row["errors"], row["errors"]
        assert row["ttft_median_ms"] > 0 and row["tpot_median_ms"] > 0 and row["output_tok_per_s"] > 0
        assert row["step_ms"] > 0 and row["roofline_ms"] > 0
    b = results["workload_b"]
    assert b["prefix_hit"]["cached_tokens_median"] >= 32 and b["cold"]["cached_tokens_median"] == 0
    assert [r["N"] for r in results["hf_ratio"]] == [1, 2]
    assert "ttft_median_ms" in proc.stdout and "prefix reuse TTFT median" in proc.stdout
    assert "errors" not in results, results.get("errors")
    (long_row,) = results["workload_a_long"]
    assert long_row["N"] == 12 and long_row["prompt_len"] == 40
    # the pools are sized for A-long's 12 rows too (run 35 sized them by --sizes and ran A-long one request at a time)
    assert long_row["all_concurrent"] and long_row["max_concurrent_rows"] == 12, long_row
    assert all(row["prefill_tok_per_s"] > 0 for row in rows + results["workload_a_long"])
    (serving,) = results["workload_c"]
    assert serving["requests"] == 6 and not serving["errors"] and serving["ttft_p50_ms"] > 0
    assert serving["itl_p99_ms"] >= serving["itl_p50_ms"] > 0 and serving["output_tok_per_s"] > 0
    assert results["meta"]["prefill_gflop_per_token"] <= results["meta"]["prefill_gflop_per_token_full"]
