"""End-to-end decode benchmark of the custom_torch backend at Gemma 4 shapes (random weights, no download).

One process: builds transformers' Gemma4ForCausalLM with seeded random bf16 weights directly on the GPU, the
custom model over the same tensors (one copy of the weights: the transformers model is dropped when no hf
comparison runs, else re-pointed at the custom model's fused tensors), then drives requests through the real
Engine/scheduler. ``--config e2b|e4b|26b-a4b|31b`` picks the shapes (gemma4-spec.md §4, the vLLM peer's presets;
default E2B); ``--quick`` runs a toy variant of that config with the same features on the CPU.

- A (decode): N concurrent distinct random prompts (512 tokens), 256 output tokens, EOS ignored, for each N:
  median TTFT, median TPOT, output tokens/s, the decode-step time (CUDA events around decode_step_batched,
  and around the CUDA-graph replay alone) against the HBM roofline (bytes read per step / measured copy BW);
- B (prefix reuse): 64 requests = one shared 1536-token prefix + 64 own tokens; median TTFT with the prefix
  cached (warmed by one earlier request) vs. 64 distinct 1600-token prompts (nothing cached);
- A-long (--long-sizes): workload A with 2,048-token prompts; each A / A-long row records whether its N requests
  ran together (``all_concurrent``: MAX_BATCH_SIZE, the KV pools and MAX_ACTIVE_KV_TOKENS hold them) and the most
  rows one decode step carried (``max_concurrent_rows``), and its prefill against the compute roofline on both
  FLOP bases (fast prefill's and the full forward's, at the workload's own attention context);
- C (--serving-rates): Poisson arrivals (``serving_workloads.run_arrivals``), fresh prompts per (rate, repeat)
  over an emptied prefix cache (``cached_prompt_tokens`` shows ~0), TTFT from the scheduled arrival; the JSON is
  saved after every row;
- the hf_torch backend on the same model for workload A at small N (output capped, see --hf-output-len);
- a torch.profiler split of one eager decode step and one graph replay (matmul time and its achieved weight
  bandwidth against the copy bandwidth; also at --profile-more-sizes), and optionally compile on/off
  (--compile-size).

- the KV capacity report ("capacity"): per config, KV bytes per token and the most concurrent 4,096-token
  requests whose KV fits beside the weights (the backend's own pool accounting), and this run's pools.

The KV pools are sized for max(N) rows of max_model_len tokens (MAX_ACTIVE_KV_TOKENS), capped at what fits in
the memory left after the weights minus --kv-headroom-gb (on the big configs the cap is what binds).

Usage (repo root):  python benchmarks/decode.py --json out.json       (H200: about 3 minutes)
                    python benchmarks/decode.py --quick --json q.json (tiny shapes, CPU, seconds; CI smoke)
                    python benchmarks/decode.py --config 31b --sizes 1,8,32 --hf-sizes '' ...  (big shapes)
                    python benchmarks/decode.py --quantization fp8 ...  (FP8 weights, compute capability >= 8.9)
CUSTOM_BACKEND_* env vars apply to the main custom backend (e.g. CUSTOM_BACKEND_CUDA_GRAPH=0).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_model as dm  # noqa: E402
import decode_profile as dp  # noqa: E402
from decode_workloads import StepTimer, random_prompts, run_engine  # noqa: E402
from serving_workloads import clear_prefix_cache  # noqa: E402
from timing import copy_bandwidth  # noqa: E402

from gemmaserve.settings import CoreSettings  # noqa: E402
from gemmaserve_custom_torch.settings import load_custom_settings  # noqa: E402

KV_BLOCK_SIZE = 16
H200_MEMORY_BYTES = 143771 * 2**20
_PREFILL_NOTE = (
    "meta prefill_gflop_per_token(_full): at a fixed mean context of 256 keys (prefill_gflop_per_token_context); "
    "rows carry prefill_gflop_per_token_fast/_full at their own prompts' mean context (B's prefix hit: its own "
    "tokens after the cached prefix). _fast: the KV-shared tail skipped (what the forward executes with fast "
    "prefill), _full: every layer for every prompt token (what a forward without fast prefill, e.g. vLLM or hf, "
    "computes). prefill_pct_of_compute_roofline uses prefill_pct_of_compute_roofline_basis; both bases are "
    "reported as prefill_pct_of_compute_roofline_fast_flops / _full_flops (tok/s x FLOPs per token / gemm_tflops).")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("decode_results.json"), help="where to write all results")
    p.add_argument("--quick", action="store_true", help="tiny shapes and counts (CPU smoke run)")
    p.add_argument("--config", choices=list(dm.CONFIGS), default="e2b",
                   help="Gemma 4 shapes (with --quick: a toy variant with the same features)")
    p.add_argument("--max-active-kv-tokens", type=int, default=0, help="the KV token budget (0 = max(N) x "
                   "max_model_len, capped at what fits beside the weights and --kv-headroom-gb)")
    p.add_argument("--kv-headroom-gb", type=float, default=10.0, help="GiB kept free of weights and KV pools "
                   "(activations, CUDA graphs, allocator slack); also used by the capacity report")
    p.add_argument("--capacity-memory-gb", type=float, default=None, help="device memory (GB, 1e9) assumed by "
                   "the capacity report (default: this CUDA device's total, else one H200's 143771 MiB)")
    p.add_argument("--sizes", default="1,8,32,128,256", help="workload A concurrencies")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-sizes", default="1,8,32")
    p.add_argument("--hf-output-len", type=int, default=None, help="output tokens per hf request (default: "
                   "--output-len; hf is slow, but the hf ratio is only reported when the two are equal)")
    p.add_argument("--prefix-len", type=int, default=1536)
    p.add_argument("--prefix-requests", type=int, default=64, help="workload B requests (0 = skip B)")
    p.add_argument("--prefix-own", type=int, default=64, help="distinct tokens after the shared prefix")
    p.add_argument("--profile-size", type=int, default=32, help="rows of the profiled eager step (0 = skip)")
    p.add_argument("--profile-more-sizes", default="1", help="with --profile-size: also profile the decode step at "
                   "these rows (JSON profile_by_rows, --profile-size itself skipped; issue 14's matmul bandwidth "
                   "target is at N = 1; '' = none)")
    p.add_argument("--compile-size", type=int, default=0, help="also measure CUSTOM_BACKEND_COMPILE=1 at N (0 = skip)")
    p.add_argument("--eager-sizes", default="1,32", help="also run these N with CUDA graphs off (64 tokens)")
    p.add_argument("--sync-sizes", default="", help="also run workload A at these N with ASYNC_SCHEDULING=0")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the scheduler's per-tick token budget")
    p.add_argument("--prefill-chunk-tokens", type=int, default=512, help="the scheduler's per-request chunk cap")
    p.add_argument("--mixed-prefill-chunk-tokens", type=int, default=None,
                   help="the chunk cap in ticks with decoding rows (default: the setting's default)")
    p.add_argument("--long-sizes", default="", help="workload A-long concurrencies (2,048-token prompts; '' = skip)")
    p.add_argument("--long-prompt-len", type=int, default=2048)
    p.add_argument("--long-output-len", type=int, default=128)
    p.add_argument("--serving-rates", default="", help="workload C Poisson rates per second ('' = skip)")
    p.add_argument("--serving-requests", type=int, default=1000)
    p.add_argument("--serving-repeats", type=int, default=1, help="workload C runs per rate (arrival seeds differ)")
    p.add_argument("--serving-max-rows", type=int, default=None, help="with --serving-rates: the engine's row and KV "
                   "pool size is at least this many requests (workload C's concurrency limit; default 256)")
    p.add_argument("--serving-input", default="128,2048", help="workload C prompt lengths: uniform in [lo, hi]")
    p.add_argument("--serving-output", default="32,512", help="workload C output lengths: uniform in [lo, hi]")
    p.add_argument("--mixed-profiles", default="tick,chunk", help="tick: a 16 x 512-token tick profiled; chunk: "
                   "decode rows with one chunk of 0-512 tokens (workload C's mixed tick); '' = neither")
    p.add_argument("--skip-prefill-profile", action="store_true", help="skip the prefill-path profile section")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: the custom model's projections and "
                   "experts quantized to FP8 at load (QUANTIZATION=fp8); the hf comparison stays in the model dtype")
    p.add_argument("--switch-interval", type=float, default=None, help="Python's thread switch interval in seconds "
                   "for the whole run (sys.setswitchinterval; default: Python's 0.005)")
    args = p.parse_args(argv)
    if args.switch_interval is not None and not 0 < args.switch_interval <= 1:
        p.error(f"--switch-interval must be in (0, 1] seconds, got {args.switch_interval}")
    if args.serving_max_rows is not None and not args.serving_rates:
        p.error("--serving-max-rows sizes the engine for workload C; add --serving-rates")
    if args.serving_max_rows is not None and args.serving_max_rows < 1:
        p.error(f"--serving-max-rows must be at least 1, got {args.serving_max_rows}")
    if args.serving_repeats < 1:
        p.error(f"--serving-repeats must be at least 1, got {args.serving_repeats}")
    if args.serving_max_rows is None:
        args.serving_max_rows = 256
    if args.hf_output_len is None:
        args.hf_output_len = args.output_len
    if args.quick:
        args.sizes, args.hf_sizes, args.prompt_len, args.output_len, args.hf_output_len = "1,2", "1,2", 24, 6, 6
        args.prefix_len, args.prefix_requests, args.prefix_own, args.profile_size = 32, 4, 4, 0
        args.eager_sizes = ""
        args.serving_input, args.serving_output = "8,40", "2,8"
        args.serving_max_rows = min(args.serving_max_rows, 8)
    return args


def _settings(device: str, dtype: str, max_rows: int, max_len: int, tokens: int, budget: int = 8192,
              chunk: int = 512, mixed_chunk: int | None = None) -> CoreSettings:
    mixed = {} if mixed_chunk is None else {"mixed_prefill_chunk_tokens": mixed_chunk}
    return CoreSettings(device=device, dtype=dtype, max_batch_size=max_rows, max_model_len=max_len, **mixed,
                        max_active_kv_tokens=tokens, kv_block_size=KV_BLOCK_SIZE, prefill_chunk_tokens=chunk,
                        max_waiting_requests=4096, max_num_batched_tokens=max(budget, max_rows))


def _custom_backend(model: Any, settings: CoreSettings, tokenizer: Any = None, name: str = "e2b-random",
                    **custom: Any) -> Any:
    from gemmaserve_custom_torch.backend import CustomTorchBackend
    from gemmaserve_custom_torch.settings import load_custom_settings

    return CustomTorchBackend(model, tokenizer or dm.IdsOnlyTokenizer(), settings, load_custom_settings(**custom),
                              name=name)


def _gb(nbytes: int) -> float:
    return round(nbytes / 1e9, 3)


def _kv_tokens(args: argparse.Namespace, config: Any, device: str, itemsize: int, block_size: int, max_rows: int,
               max_len: int) -> tuple[int, int | None]:
    """(MAX_ACTIVE_KV_TOKENS, KV bytes left after the weights and the headroom; None off CUDA). Default:
    ``max_rows`` rows of ``max_len`` tokens, capped at the tokens whose pools (the backend's ``_budget_bytes``:
    uniform blocks for the tokens plus one per row) fit in that memory."""
    wanted = args.max_active_kv_tokens or max_rows * max_len
    if device != "cuda":
        return wanted, None  # the backend caps CPU pools at a quarter of the RAM itself
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # cached blocks (the bandwidth probe's buffers) count as free
    free, _ = torch.cuda.mem_get_info()
    left = max(0, free - int(args.kv_headroom_gb * 2**30))
    if args.max_active_kv_tokens:
        return wanted, left
    fit = dm.kv_tokens_fitting(config, itemsize, block_size, left, max_rows)
    if fit < max_len:
        raise SystemExit(f"KV: {left / 1e9:.1f} GB left after the weights and --kv-headroom-gb holds {fit} tokens, "
                         f"fewer than one {max_len}-token row; lower --kv-headroom-gb or the sizes")
    if fit < wanted:
        print(f"KV: {max_rows} rows x {max_len} tokens do not fit; MAX_ACTIVE_KV_TOKENS={fit} "
              f"({left / 1e9:.1f} GB after weights and headroom)", flush=True)
    return min(wanted, fit), left


def _capacity(args: argparse.Namespace, backend: Any, model: Any, device: str, itemsize: int, block_size: int,
              kv_left: int | None, request_tokens: int = 4096) -> dict[str, Any]:
    """The capacity report: every config at full size (bf16, this device's memory or --capacity-memory-gb,
    minus --kv-headroom-gb) and this run's pools as the backend built them."""
    if args.capacity_memory_gb is not None:
        total, source = int(args.capacity_memory_gb * 1e9), "--capacity-memory-gb"
    elif device == "cuda":
        total, source = torch.cuda.get_device_properties(0).total_memory, "this CUDA device's total memory"
    else:  # what torch reports for one H200 on the lent machines (nvidia-smi: 143771 MiB)
        total, source = H200_MEMORY_BYTES, "assumed: one H200 (143771 MiB)"
    headroom = int(args.kv_headroom_gb * 2**30)
    admission = backend.admission
    need = admission.footprint(request_tokens)
    this_run: dict[str, Any] = {
        "kv_pools_bytes": backend.pools.nbytes, "blocks": dict(admission.capacity),
        "blocks_per_request": need, "block_size": backend.block_size,
        # what KVAdmission admits at once (the scheduler's MAX_ACTIVE_KV_TOKENS may bind first)
        "max_concurrent_requests_in_pools": min(admission.capacity[g] // n for g, n in need.items()),
        # the same for one workload A request (prompt + output tokens)
        "workload_a_request_tokens": args.prompt_len + args.output_len,
        "max_concurrent_workload_a_requests_in_pools": min(
            admission.capacity[g] // n for g, n in admission.footprint(args.prompt_len + args.output_len).items()),
    }
    if kv_left is not None:  # measured: free memory with this run's weights resident, minus the headroom
        this_run["measured"] = dm.kv_capacity(model.config, itemsize, block_size, kv_left,
                                              request_tokens=request_tokens, chunk_tokens=args.prefill_chunk_tokens)
    return {
        "request_tokens": request_tokens, "device_memory_bytes": total, "device_memory_source": source,
        "headroom_bytes": headroom, "block_size": block_size,
        "note": "KV bytes per token count K and V of every KV-storing layer (KV-shared layers store nothing; K=V "
                "layers still store two tensors: K = rope(k_norm(k)) and V = v_norm(k) differ); a request's "
                "sliding blocks are bounded by the window (KVAdmission's footprint). max_concurrent_requests: "
                "pools split to fit (CUSTOM_BACKEND_SLIDING_BLOCKS = sliding_blocks_for_max); "
                "default_plan_requests: the backend's default split of the same memory (plan_pools_for_settings "
                "with MAX_BATCH_SIZE = max_concurrent_requests and MAX_ACTIVE_KV_TOKENS = that many requests' "
                "tokens: the pools run out together at default_plan_reference_tokens).",
        "configs": dm.capacity_table(total, headroom, block_size=block_size, request_tokens=request_tokens,
                                     chunk_tokens=args.prefill_chunk_tokens),
        "this_run": this_run,
    }


def _workload_a(backend: Any, settings: CoreSettings, sizes: list[int], args: argparse.Namespace, roof: Any,
                bandwidth: float, output_len: int, label: str) -> list[dict[str, Any]]:
    rows = []
    vocab = backend.model_info.vocab_size
    mixed = getattr(backend, "mixed", None)
    for n in sizes:
        # prompts of their own per (seed, N, label), on an emptied prefix cache: A is cold prompts (labels of one
        # length once drew the same prompts, and a second run at an N hit the first run's cached blocks)
        prompts = random_prompts(n, args.prompt_len, vocab, seed=zlib.crc32(f"{args.seed}/{n}/{label}".encode()))
        clear_prefix_cache(backend)
        method = ("decode_step_async" if settings.async_scheduling and backend.capabilities.async_decode
                  else "decode_step_batched")
        step = StepTimer(backend, method, lambda batch, ids, *rest: len(ids), settings.device)
        replay = None
        if mixed is not None and mixed.graphs is not None:  # decode-only graph replays, keyed by row bucket
            replay = StepTimer(mixed.graphs, "run", lambda key: key[0] if key[1] else -key[0], settings.device)
        result = run_engine(backend, settings, prompts, output_len)
        step.restore()
        if replay is not None:
            replay.restore()
        row = {"backend": label, "N": n, **result.summary(), "step_ms": _r(step.median_ms(n)),
               "graph_replay_ms": _r(replay.median_ms(n)) if replay is not None else None}
        row.update(_concurrency(backend, settings, n, args.prompt_len + output_len, step.records))
        if result.ttft_ms:  # all submitted at once: the last first token ends the batch's prefill
            row["ttft_max_ms"] = round(max(result.ttft_ms), 3)
            row.update(_prefill_rate(args, n, len(prompts[0]), 0, max(result.ttft_ms)))
        context = args.prompt_len + output_len // 2
        floor_ms = roof.step_bytes(n, context) / bandwidth * 1e3
        row["roofline_ms"] = _r(floor_ms)
        if roof.num_experts:  # distinct experts per MoE layer the roofline reads (approximate for N > 1)
            row["roofline_experts_read"] = round(roof.experts_read(n), 2)
        row["roofline_context"] = context
        measured = row["graph_replay_ms"] or row["step_ms"]
        row["pct_of_roofline"] = round(100 * floor_ms / measured, 1) if measured else None  # the step (replay) only
        tpot = row.get("tpot_median_ms")  # what a stream sees: the step plus sampling and host work
        row["pct_of_roofline_tpot"] = round(100 * floor_ms / tpot, 1) if tpot else None
        rows.append(row)
        print(f"  {label} N={n}: {row}", flush=True)
    return rows


def _concurrency(backend: Any, settings: CoreSettings, n: int, request_tokens: int,
                 records: list[tuple[int, Any, Any]]) -> dict[str, Any]:
    """Whether workload A's ``n`` requests of ``request_tokens`` (prompt + output) tokens could all run at once:
    ``all_concurrent`` = n within MAX_BATCH_SIZE, within the requests the KV pools hold (``KVAdmission``'s
    footprint; backends without one: not checked) and within MAX_ACTIVE_KV_TOKENS; ``max_concurrent_rows`` = the
    most rows one timed decode step carried (``StepTimer.records``; None when no step ran)."""
    admission = getattr(backend, "admission", None)
    in_pools = None
    if admission is not None:
        need = admission.footprint(request_tokens)
        in_pools = min((admission.capacity[g] // k for g, k in need.items() if k), default=None)
    in_budget = settings.max_active_kv_tokens // request_tokens
    fits = n <= settings.max_batch_size and n <= in_budget and (in_pools is None or n <= in_pools)
    return {"all_concurrent": fits, "max_concurrent_rows": max((rows for rows, *_ in records), default=None),
            "kv_pool_requests": in_pools, "kv_budget_requests": in_budget}


def _prefill_rate(args: argparse.Namespace, requests: int, tokens: int, start: int, last_ttft_ms: float
                  ) -> dict[str, Any]:
    """Prefill throughput of ``requests`` prompts of ``tokens`` uncached tokens each (after ``start`` cached
    ones), submitted at once, whose last first token came ``last_ttft_ms`` after the submit; with the model's
    ``args.prefill`` (a ``PrefillFlops``): the FLOPs per token at this prompt's mean attention context, fast
    (KV-shared tail skipped: what the forward executes with fast prefill) and full (every layer), and with
    ``args.prefill_flops_per_s`` (the GEMM ceiling, CUDA only) the % of the compute roofline on each basis.
    ``prefill_pct_of_compute_roofline`` is the basis this run executes (``args.prefill_fast``)."""
    out: dict[str, Any] = {"prefill_tok_per_s": round(requests * tokens / (last_ttft_ms / 1e3), 1)}
    flops = getattr(args, "prefill", None)
    if flops is None or tokens < 1:
        return out
    per = {basis: flops.per_token(fast=basis == "fast", prompt_len=tokens, start=start) for basis in ("fast", "full")}
    out.update(prefill_gflop_per_token_fast=round(per["fast"] / 1e9, 4),
               prefill_gflop_per_token_full=round(per["full"] / 1e9, 4))
    ceiling = getattr(args, "prefill_flops_per_s", 0.0)
    if ceiling:
        pcts = {basis: round(100 * out["prefill_tok_per_s"] * f / ceiling, 1) for basis, f in per.items()}
        out.update(prefill_pct_of_compute_roofline=pcts["fast" if args.prefill_fast else "full"],
                   prefill_pct_of_compute_roofline_fast_flops=pcts["fast"],
                   prefill_pct_of_compute_roofline_full_flops=pcts["full"])
    return out


def _workload_b(backend: Any, settings: CoreSettings, args: argparse.Namespace) -> dict[str, Any]:
    vocab = backend.model_info.vocab_size
    own, total = args.prefix_own, args.prefix_len + args.prefix_own
    # warm-up of both shapes with prompts of their own (lazily captured tick graphs are not timed)
    run_engine(backend, settings, random_prompts(1, total, vocab, seed=args.seed + 5), 2)
    warm_prefix = random_prompts(1, args.prefix_len, vocab, seed=args.seed + 6)[0]
    run_engine(backend, settings, [warm_prefix], 1)
    run_engine(backend, settings, random_prompts(1, own, vocab, seed=args.seed + 9, prefix=warm_prefix), 2)
    cold = run_engine(backend, settings, random_prompts(args.prefix_requests, total, vocab, seed=args.seed + 7), 8)
    prefix = random_prompts(1, args.prefix_len, vocab, seed=args.seed + 8)[0]
    # warm the cache with one request of prefix + its own tokens (the prefix cache keeps the prompt's blocks
    # progressively, chunk by chunk, so the sliding blocks at the prefix boundary stay reusable)
    run_engine(backend, settings, random_prompts(1, own, vocab, seed=args.seed + 11, prefix=prefix), 1)
    hit = run_engine(backend, settings, random_prompts(args.prefix_requests, own, vocab, seed=args.seed + 10,
                                                       prefix=prefix), 8)
    out = {"requests": args.prefix_requests, "prefix_len": args.prefix_len, "own_len": own, "output_len": 8,
           "cold": cold.summary(), "prefix_hit": hit.summary()}
    for key, run in (("cold", cold), ("prefix_hit", hit)):  # every request submitted at once
        cached = round(statistics.median(run.cached_tokens)) if run.cached_tokens else 0
        if run.ttft_ms and total > cached:  # a hit's own tokens attend to the cached prefix too
            out[key].update(_prefill_rate(args, len(run.ttft_ms), total - cached, cached, max(run.ttft_ms)))
    c, h = out["cold"]["ttft_median_ms"], out["prefix_hit"]["ttft_median_ms"]
    out["hit_over_cold_pct"] = round(100 * h / c, 1) if c and h else None
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    dtype, dtype_name = (torch.bfloat16, "bfloat16") if device == "cuda" else (torch.float32, "float32")
    label, full_size, toy = dm.CONFIGS[args.config]
    base = toy if args.quick else full_size
    sizes = [int(x) for x in args.sizes.split(",")]
    hf_sizes = [int(x) for x in args.hf_sizes.split(",") if x]
    results: dict[str, Any] = {"meta": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "quick": args.quick,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "argv": sys.argv[1:],
        "config": ("tiny" if args.config == "e2b" else f"{label}-tiny") if args.quick else label,
        "preset": args.config, "switch_interval_s": sys.getswitchinterval()}}

    def save() -> None:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")

    t0 = time.perf_counter()
    longest = max(args.long_prompt_len + args.long_output_len if args.long_sizes else 0,
                  sum(int(x.split(",")[1]) for x in (args.serving_input, args.serving_output))
                  if args.serving_rates else 0)
    if longest > base["max_position_embeddings"]:  # room for A-long's / C's prompts and outputs
        base = {**base, "max_position_embeddings": longest}
    memory: dict[str, Any] = {}
    hf_model = dm.build_hf_model(base, device, dtype, args.seed)  # on the device, in dtype, seeded
    model = dm.custom_from_hf(hf_model)  # the same tensors
    memory["build_only_s"] = round(time.perf_counter() - t0, 2)
    memory["held_bytes_after_build"] = dm.held_bytes(hf_model, model)  # hf + custom: one copy
    if device == "cuda":
        torch.cuda.synchronize()
        memory["cuda_peak_gb_after_build"] = _gb(torch.cuda.max_memory_allocated())
    # One copy of the weights from here on: without an hf comparison the transformers model goes (the custom
    # model's tensors are the only references, so FP8 quantization and the backend's q/k/v + gate/up fusion free
    # each original as they replace it); with one, it lets go of the shared tensors until the backend has fused
    # them, then reads the fused ones (dm.release_shared / dm.retie). With FP8 it keeps its own model-dtype copy.
    hf_slots = None
    if not hf_sizes:
        hf_model = None
        gc.collect()
    elif args.quantization is None:
        hf_slots = dm.release_shared(hf_model, model)
    if args.quantization == "fp8":
        from gemmaserve_custom_torch.models import quantization

        quantization.check_fp8_device(device, dtype)
        quantization.quantize_fp8(model)  # new FP8 tensors (few-row products: CUSTOM_BACKEND_SKINNY_MAX_ROWS)
    if device == "cuda":
        torch.cuda.empty_cache()
    results["meta"]["quantization"] = args.quantization
    weight_bytes = memory["weight_bytes"] = dm.held_bytes(model)  # every custom-model tensor (FP8: quantized)
    roof = dm.roofline(model)
    bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 24))
    results["meta"].update(build_s=round(time.perf_counter() - t0, 1), copy_bandwidth_tbps=round(bandwidth / 1e12, 3),
                           weight_gb_per_step=round(roof.step_weight_bytes(1) / 1e9, 3),
                           weight_gb_resident=_gb(weight_bytes))
    if roof.num_experts:
        results["meta"].update(moe_experts=roof.num_experts, moe_top_k=roof.top_k,
                               moe_gb_per_expert=round(roof.expert_bytes / 1e9, 4))
    results["memory"] = memory
    save()
    # workloads C and A-long size the engine too: sized by --sizes 1 alone, its pools held one request and C (and
    # A-long, run 35) ran serially
    long_sizes = [int(x) for x in args.long_sizes.split(",") if x]
    max_rows = max(sizes + long_sizes + [args.prefix_requests]
                   + ([args.serving_max_rows] if args.serving_rates else []))
    max_len = base["max_position_embeddings"]
    block_size = load_custom_settings().block_size or KV_BLOCK_SIZE  # what the backend will use
    kv_item = torch.tensor([], dtype=dtype).element_size()  # KV stays in the model dtype (also with FP8 weights)
    tokens, kv_left = _kv_tokens(args, model.config, device, kv_item, block_size, max_rows, max_len)
    memory.update(kv_tokens_wanted=max_rows * max_len, max_active_kv_tokens=tokens,
                  kv_gb_left_after_weights=_gb(kv_left) if kv_left is not None else None)
    settings = _settings(device, dtype_name, max_rows, max_len, tokens, args.max_num_batched_tokens,
                         args.prefill_chunk_tokens, args.mixed_prefill_chunk_tokens)
    from serving_workloads import PrefillFlops, gemm_tflops, run_arrivals, serving_requests, serving_seed

    fast = load_custom_settings().fast_prefill  # every prompt token runs in the tick forward
    args.prefill, args.prefill_fast = PrefillFlops.from_model(model), fast  # before the backend fuses projections
    flops = args.prefill.per_token(fast=fast)
    tflops = gemm_tflops(device)
    args.prefill_flops_per_s = tflops * 1e12
    results["meta"].update(prefill_gflop_per_token=round(flops / 1e9, 3), fast_prefill=fast,
                           prefill_gflop_per_token_full=round(args.prefill.per_token(fast=False) / 1e9, 3),
                           prefill_gflop_per_token_context=256,
                           prefill_pct_of_compute_roofline_basis="fast_flops" if fast else "full_flops",
                           prefill_flops_note=_PREFILL_NOTE,
                           gemm_tflops=round(tflops, 1), max_num_batched_tokens=settings.max_num_batched_tokens,
                           prefill_chunk_tokens=settings.prefill_chunk_tokens,
                           mixed_prefill_chunk_tokens=settings.mixed_prefill_chunk_tokens)

    def section(name: str, fn: Any) -> Any:
        """Run one section; a failure is recorded (with its traceback) and the next section still runs."""
        try:
            value = fn()
            if value is not None:
                results[name] = value
            return value
        except Exception:
            results.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            print(f"section {name} failed:\n{results['errors'][name]}", flush=True)
            return None
        finally:
            save()

    backend = _custom_backend(model, settings, name=f"{args.config}-random")
    if hf_slots is not None:  # the backend fused q/k/v and gate/up: hf reads the same (fused) tensors
        dm.retie(hf_slots, model)
    memory["held_bytes_after_backend"] = dm.held_bytes(hf_model, model)  # weights (fused), no duplicate
    memory["kv_pools_gb"] = _gb(backend.pools.nbytes)
    if device == "cuda":
        torch.cuda.synchronize()
        memory["cuda_peak_gb_after_backend"] = _gb(torch.cuda.max_memory_allocated())
        memory["cuda_allocated_gb_after_backend"] = _gb(torch.cuda.memory_allocated())
    section("capacity", lambda: _capacity(args, backend, model, device, kv_item, block_size, kv_left))
    mixed = getattr(backend, "mixed", None)
    graphed = mixed is not None and mixed.graphs is not None
    if graphed:  # one capture_all: decode-only row buckets (graph_capture_s) and token buckets (tick_...)
        def capture() -> dict[str, dict[str, float]]:  # seconds per decode row bucket, per tick bucket x logits rows
            seconds = mixed.capture_all()
            return {"decode": {str(b): round(v, 3) for (b, decode_only, _), v in seconds.items() if decode_only},
                    "tick": {f"{b}x{rows}": round(v, 3) for (b, decode_only, rows), v in seconds.items()
                             if not decode_only}}

        captured = section("graph_capture_s", capture)
        if captured is None:
            backend.close()  # its pools go before the eager backend allocates its own
            backend = _custom_backend(model, settings, cuda_graph=False, name=f"{args.config}-random")
            graphed = False  # keep measuring, eagerly
        else:
            results["graph_capture_s"], results["tick_graph_capture_s"] = captured["decode"], captured["tick"]
    vocab = base["vocab_size"]
    run_engine(backend, settings, random_prompts(2, args.prompt_len, vocab, seed=99), 4)  # warm-up
    print(f"built in {results['meta']['build_s']} s; copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    section("workload_a",
            lambda: _workload_a(backend, settings, sizes, args, roof, bandwidth, args.output_len, "custom"))
    if args.prefix_requests:
        section("workload_b", lambda: _workload_b(backend, settings, args))
    if long_sizes:
        long_args = argparse.Namespace(**{**vars(args), "prompt_len": args.long_prompt_len})
        section("workload_a_long", lambda: _workload_a(backend, settings, long_sizes, long_args, roof, bandwidth,
                                                       args.long_output_len, "custom-long"))
    rates = [float(x) for x in args.serving_rates.split(",") if x]
    if rates:
        def serving() -> list[dict[str, Any]]:
            """One row per (rate, repeat), each with fresh prompts (``serving_seed``) over an emptied prefix
            cache (``run_arrivals``); the JSON is saved after every row (a killed run keeps the finished ones)."""
            inputs, outputs = (tuple(map(int, x.split(","))) for x in (args.serving_input, args.serving_output))
            rows: list[dict[str, Any]] = []
            for rate in rates:
                for repeat in range(args.serving_repeats):  # the ITL tail is noisy: repeats give its spread
                    prompt_seed = serving_seed(args.seed, rate, repeat)
                    work = serving_requests(args.serving_requests, inputs, outputs, vocab, prompt_seed)
                    row = run_arrivals(backend, settings, work, rate, seed=args.seed + int(rate * 10) + 1000 * repeat)
                    row["repeat"], row["prompt_seed"] = repeat, prompt_seed
                    if row.get("itl_p50_ms"):
                        row["itl_p99_over_p50"] = round(row["itl_p99_ms"] / row["itl_p50_ms"], 3)
                    rows.append(row)
                    results["workload_c"] = rows
                    save()
                    print(f"  serving rate {rate}/s (repeat {repeat}): {row}", flush=True)
            clear_prefix_cache(backend)  # later sections start as they did before C ran
            return rows

        section("workload_c", serving)
    if device == "cuda" and getattr(backend, "mixed", None) is not None and backend.mixed.graphs is not None:
        if "tick" in args.mixed_profiles.split(","):
            section("mixed_tick_profile", lambda: dp.profile_mixed_tick(backend))
        if "chunk" in args.mixed_profiles.split(","):
            section("decode_with_chunk_profile",
                    lambda: dp.profile_decode_with_chunk(backend, roof=roof, bandwidth=bandwidth))
    if device == "cuda" and not args.skip_prefill_profile:
        section("prefill_profile", lambda: dp.profile_prefill_paths(backend, args.prompt_len))
    if args.profile_size and graphed and device == "cuda":
        section("profile", lambda: dp.profile_decode_step(backend, settings, args.profile_size, args.prompt_len,
                                                          roof, bandwidth))
        more = [n for n in dict.fromkeys(int(x) for x in args.profile_more_sizes.split(",") if x)
                if n != args.profile_size]  # --profile-size 1 (.devrun/r2.sh) already profiled N = 1
        if more:
            section("profile_by_rows", lambda: _profiles(backend, settings, more, args.prompt_len, roof, bandwidth))
        section("sdpa_backends", lambda: dp.sdpa_backends(device, dtype))
    if hf_sizes:
        def hf_runs() -> list[dict[str, Any]]:
            from gemmaserve_hf_torch.backend import HFTorchBackend

            hf = HFTorchBackend.from_model(hf_model, max_model_len=max_len)
            hf_settings = _settings(device, dtype_name, max(hf_sizes), max_len, max(hf_sizes) * max_len)
            run_engine(hf, hf_settings, random_prompts(1, args.prompt_len, vocab, seed=98), 2)  # warm-up
            return _workload_a(hf, hf_settings, hf_sizes, args, roof, bandwidth, args.hf_output_len, "hf")

        if section("hf", hf_runs) is not None:
            section("hf_ratio", lambda: _ratios(results["workload_a"], results["hf"],
                                                args.hf_output_len == args.output_len))
    eager_sizes = [int(x) for x in args.eager_sizes.split(",") if x]
    if eager_sizes and graphed:
        def eager_runs() -> list[dict[str, Any]]:
            eager = _custom_backend(model, settings, cuda_graph=False)
            rows = _workload_a(eager, settings, eager_sizes, args, roof, bandwidth, 64, "custom-no-graph")
            eager.close()
            return rows

        section("no_graph", eager_runs)
    sync_sizes = [int(x) for x in args.sync_sizes.split(",") if x]
    if sync_sizes:
        sync = settings.model_copy(update={"async_scheduling": False})
        section("workload_a_sync",
                lambda: _workload_a(backend, sync, sync_sizes, args, roof, bandwidth, args.output_len, "custom-sync"))
    if args.compile_size and graphed:
        section("compile", lambda: dp.compile_on_off(_custom_backend, model, settings, args, roof, bandwidth,
                                                     _workload_a, backend))
    _print_tables(results)
    save()
    return results


def _profiles(backend: Any, settings: CoreSettings, sizes: list[int], prompt_len: int, roof: Any,
              bandwidth: float) -> dict[str, Any]:
    """``dp.profile_decode_step`` at each of ``sizes`` rows, keyed by the row count; a size that fails records its
    error and the next still runs."""
    out: dict[str, Any] = {}
    for n in sizes:
        try:
            out[str(n)] = dp.profile_decode_step(backend, settings, n, prompt_len, roof, bandwidth)
        except Exception:
            out[str(n)] = {"error": traceback.format_exc()[-3000:]}
    return out


def _ratios(custom: list[dict[str, Any]], hf: list[dict[str, Any]], same_length: bool) -> list[dict[str, Any]]:
    """hf against custom at each N both ran; empty unless both ran the same output length (tok/s counts the
    prefill in its wall time and TPOT grows with the context, so unequal lengths would skew the ratio)."""
    if not same_length:
        print("  hf_ratio skipped: --hf-output-len differs from --output-len", flush=True)
        return []
    out = []
    by_n = {row["N"]: row for row in custom}
    for row in hf:
        mine = by_n.get(row["N"])
        if mine and row["tpot_median_ms"] and mine["tpot_median_ms"]:
            out.append({"N": row["N"], "tpot_speedup": round(row["tpot_median_ms"] / mine["tpot_median_ms"], 1),
                        "tok_per_s_speedup": round(mine["output_tok_per_s"] / row["output_tok_per_s"], 1),
                        "ttft_speedup": round(row["ttft_median_ms"] / mine["ttft_median_ms"], 1)})
    return out


def _print_tables(results: dict[str, Any]) -> None:
    cols = ["backend", "N", "ttft_median_ms", "tpot_median_ms", "output_tok_per_s", "step_ms", "graph_replay_ms",
            "roofline_ms", "pct_of_roofline"]
    print("\n" + " | ".join(cols))
    for row in (results.get("workload_a", []) + results.get("workload_a_long", []) + results.get("no_graph", [])
                + results.get("workload_a_sync", []) + results.get("hf", [])):
        print(" | ".join(str(row.get(c)) for c in cols), "| prefill tok/s", row.get("prefill_tok_per_s"),
              row.get("prefill_pct_of_compute_roofline"), "| all concurrent", row.get("all_concurrent"),
              row.get("max_concurrent_rows"))
    for row in results.get("workload_c", []):
        print(f"C rate {row['rate_per_s']}/s (repeat {row.get('repeat', 0)}): TTFT p50/p99 {row['ttft_p50_ms']}/"
              f"{row['ttft_p99_ms']} ms, ITL p50/p99 {row['itl_p50_ms']}/{row['itl_p99_ms']} ms "
              f"({row.get('itl_p99_over_p50')}x), TPOT p50 {row['tpot_p50_ms']} ms, "
              f"{row['output_tok_per_s']} out tok/s, {row['input_tok_per_s']} input tok/s offered, arrivals at "
              f"{row.get('arrival_rate_per_s')}/s, cached prompt tokens {row.get('cached_prompt_tokens')}")
    for name, profile in [("profile", results.get("profile", {}))] + [
            (f"profile N={n}", p) for n, p in results.get("profile_by_rows", {}).items()]:
        for label in ("eager_step", "graph_replay_step"):
            got = profile.get(label, {}) if isinstance(profile, dict) else {}
            if got.get("matmul_us"):
                print(f"{name} {label}: matmul {got['matmul_us']} us, {got['matmul_achieved_tbps']} TB/s = "
                      f"{got['matmul_pct_of_copy_bandwidth']}% of copy bandwidth")
    if "workload_b" in results:
        b = results["workload_b"]
        print(f"\nprefix reuse TTFT median: cold {b['cold']['ttft_median_ms']} ms, "
              f"hit {b['prefix_hit']['ttft_median_ms']} ms ({b['hit_over_cold_pct']}% of cold), "
              f"cached tokens {b['prefix_hit']['cached_tokens_median']}")
    for row in results.get("hf_ratio", []):
        print(f"custom vs hf at N={row['N']}: TPOT x{row['tpot_speedup']}, tok/s x{row['tok_per_s_speedup']}, "
              f"TTFT x{row['ttft_speedup']}")
    if "compile" in results:
        print(f"compile on/off: {json.dumps(results['compile'])}")
    if "capacity" in results:
        cap = results["capacity"]
        print(f"\nKV capacity, {cap['request_tokens']}-token requests, {cap['device_memory_bytes'] / 1e9:.1f} GB "
              f"device ({cap['device_memory_source']}) - weights - {cap['headroom_bytes'] / 2**30:.0f} GiB headroom:")
        for name, row in cap["configs"].items():
            print(f"  {name}: weights {row['weight_bytes'] / 1e9:.1f} GB, KV {row['kv_bytes_per_token_total']} B/token "
                  f"({row['kv_bytes_per_request'] / 1e6:.1f} MB/request), max {row['max_concurrent_requests']} "
                  f"concurrent (default pool split: {row['default_plan_requests']})")
        run = cap["this_run"]
        print(f"  this run's pools: {run['kv_pools_bytes'] / 1e9:.2f} GB, {run['max_concurrent_requests_in_pools']} "
              f"x {cap['request_tokens']}-token requests, {run['max_concurrent_workload_a_requests_in_pools']} x "
              f"{run['workload_a_request_tokens']}-token workload A requests")


if __name__ == "__main__":
    main()
