"""Host time per scheduler tick of the custom_torch decode path and of its prompt-carrying ticks (``--prefill``),
with the model forward stubbed out (CPU).

What a decode step costs the host besides the GPU work: the scheduler's per-request bookkeeping (tokens,
events), the backend's block bookkeeping of rows crossing a block boundary, and staging the fixed decode
buffers. A tiny random Gemma 4 checkpoint is built in a temporary folder; `StaticDecoder`'s forward is
replaced by precomputed logits, so the time measured is host work only.

``--engine``: the same decode through the public `Engine` (its thread, the events delivered to a callback per
request, as the benchmarks and the server receive them): the TPOT median is then the host time per decode
tick of the whole path, and the time spent in garbage collections is reported with it.
``--streams`` (with ``--engine``): every request read as an ``Engine.stream`` by one task on an asyncio loop in the
main thread, as the server's generations are; also prints the engine thread's time handing a tick's events over.

``--prefill``: ``--rows`` cold prompts of ``--prompt-len`` tokens (after a ``--prefix-len`` prefix they all share
and the cache holds: workload B's prefix hits) (window 512, blocks of 16) through the
one-forward tick under the default 8192-token budget, the tick staged into the fixed buffers the CUDA graphs
replay, the forward itself stubbed: the host time each prompt-carrying tick adds before and after the GPU work.

Usage (repo root):  TRITON_INTERPRET=1 PYTHONPATH=core:plugins/custom_torch:tests \\
                    .venv/bin/python benchmarks/host_overhead.py --rows 256 [--profile] [--prefill | --engine [--streams]]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gemmaserve.engine.engine import freeze_startup_objects
from gemmaserve.engine.request import Request
from gemmaserve.engine.scheduler import ContinuousBatchScheduler
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings


def stubbed_backend(rows: int, blocks_per_row: int, attention: str = "auto", **checkpoint: int,
                    ) -> tuple[Any, CoreSettings]:
    """A custom_torch backend over a tiny random Gemma 4 checkpoint whose ticks stage the fixed buffers the CUDA
    graphs replay (``rows`` sequences, 8192 tokens) and whose forward is stubbed: every tick's logits pick token 7.
    Prompt ticks write no K/V (nothing reads it: every token comes from the stub). ``attention="triton"`` (needs
    TRITON_INTERPRET=1 on the CPU; nothing runs it) makes the backend declare asynchronous decode, as on CUDA."""
    from gemmaserve_custom_torch.backend import CustomTorchBackend
    from gemmaserve_custom_torch.mixed_step import MixedStep
    from gemmaserve_custom_torch.models import GemmaForCausalLM
    from gemmaserve_custom_torch.settings import load_custom_settings
    from gemmaserve_custom_torch.tokenizer import HFTokenizer
    from tiny_checkpoints import build_tiny_gemma4

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_gemma4(Path(tmp) / "ckpt", **checkpoint)
        model = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
        core = CoreSettings(model=str(path), device="cpu", dtype="float32", kv_block_size=16, max_batch_size=rows,
                            max_active_kv_tokens=10**7, prefill_chunk_tokens=512, max_waiting_requests=4096)
        backend = CustomTorchBackend(model, HFTokenizer.from_pretrained(path), core,
                                     load_custom_settings(attention=attention, kv_blocks=rows * blocks_per_row))
    mixed = MixedStep(model, backend.pools, "reference", fixed_buffers=True, max_tokens=core.max_num_batched_tokens,
                      max_seqs=rows, width=4096 // 16)
    logits = torch.zeros(rows, model.config.vocab_size)
    logits[:, 7] = 1.0
    greedy = logits.argmax(-1)
    mixed._bucket_forward = lambda key: (  # graph keys (bucket, decode_only, logits rows)
        (logits[: key[0]], greedy[: key[0]]) if key[1] else (logits[: key[2]],))
    backend.mixed = mixed
    return backend, core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--profile", action="store_true", help="print the top functions (cProfile)")
    parser.add_argument("--prefill", action="store_true", help="time prompt-carrying ticks instead of decode ticks")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="--prefill: a prefix every prompt shares before its own --prompt-len tokens (a cache hit)")
    parser.add_argument("--engine", action="store_true", help="decode through the Engine (events, callbacks)")
    parser.add_argument("--streams", action="store_true",
                        help="with --engine: every request an Engine.stream() read by an asyncio loop in the main "
                        "thread, as the server's generations are (the events cross threads)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="with --engine: skip the engine's gc.freeze() of the startup objects (what it saves)")
    args = parser.parse_args()
    if args.prefill:
        prefill_ticks(args)
        return

    backend, core = stubbed_backend(args.rows, blocks_per_row=24, attention="triton")  # async decode
    if args.engine:
        engine_ticks(args, backend, core)
        return
    freeze_startup_objects()  # as the engine does when it is built
    scheduler = ContinuousBatchScheduler(backend, core)
    rows = args.rows
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompts = [tuple((i * 7 + j) % 400 + 4 for j in range(20)) for i in range(rows)]
    for round_name in ("warm-up", "timed"):
        for i, prompt in enumerate(prompts):
            scheduler.add_request(Request(f"{round_name}{i}", prompt, params))
        while not scheduler.stats().num_decoding or scheduler.stats().num_prefilling:  # prompts: 8192-token ticks
            scheduler.step()
        profile = cProfile.Profile() if args.profile and round_name == "timed" else None
        ticks, start = 0, time.perf_counter()
        if profile is not None:
            profile.enable()
        while scheduler.has_work:
            scheduler.step()
            ticks += 1
        if profile is not None:
            profile.disable()
        elapsed = time.perf_counter() - start
    print(f"rows={rows}: {ticks} decode ticks, {elapsed / ticks * 1e3:.3f} ms host time per tick"
          + (" (under cProfile)" if args.profile else ""))
    if args.profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


def engine_ticks(args: argparse.Namespace, backend: object, core: CoreSettings) -> None:
    """``--engine``: TPOT of stubbed-forward decode through the Engine, and the garbage collections' share."""
    import gc
    import statistics

    from decode_workloads import profile_engine_thread, run_engine

    rows = args.rows
    if args.no_gc_freeze:
        from gemmaserve.engine import engine as engine_module

        engine_module._frozen = True  # as if already frozen: nothing is
    prompts = [[(i * 7 + j) % 400 + 4 for j in range(20)] for i in range(rows)]
    run_engine(backend, core, prompts, 8)  # warm-up; the first engine freezes the startup objects
    collecting = {"s": 0.0, "start": 0.0}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collecting["start"] = time.perf_counter()
        else:
            collecting["s"] += time.perf_counter() - collecting["start"]

    gc.callbacks.append(on_gc)
    run = (lambda: run_streams(backend, core, prompts, args.tokens)) if args.streams else (
        lambda: run_engine(backend, core, prompts, args.tokens).tpot_ms)
    cpu = time.process_time()  # this thread waits; the engine thread (and, with --streams, the loop) work
    if args.profile:  # the engine thread does the work
        tpot_ms, profile = profile_engine_thread(run)
    else:
        tpot_ms, profile = run(), None
    cpu = time.process_time() - cpu
    gc.callbacks.remove(on_gc)
    print(f"rows={rows}: engine TPOT median {statistics.median(tpot_ms):.3f} ms (host only"
          f"{', asyncio streams' if args.streams else ''}), process CPU {cpu * 1e3 / args.tokens:.3f} ms per "
          "token step (robust to a noisy machine: the run's CPU time, not its wall time; includes the prompts), "
          f"{collecting['s'] * 1e3 / args.tokens:.3f} ms per token in garbage collections"
          + (" (under cProfile)" if args.profile else ""))
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)


def run_streams(backend: Any, settings: CoreSettings, prompts: list[list[int]], output_len: int) -> list[float]:
    """``--streams``: each prompt through ``Engine.stream`` (greedy, EOS ignored), every stream read by one task
    on an asyncio loop in this thread; per request the mean gap between its tokens after the first (ms)."""
    import asyncio

    from gemmaserve.engine.engine import Engine

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = Engine(backend, settings)
    deliver, spent = engine._deliver, [0.0, 0]

    def timed_deliver(events: list[Any]) -> None:  # the engine thread's hand-over of a tick's events
        start = time.perf_counter()
        deliver(events)
        spent[0] += time.perf_counter() - start
        spent[1] += bool(events)

    engine._deliver = timed_deliver  # type: ignore[method-assign]

    async def read(stream: Any) -> float:
        first = last = None
        count = 0
        async for event in stream:
            if event.new_token_ids:
                last = time.perf_counter()
                first = first if first is not None else last
                count += len(event.new_token_ids)
        assert first is not None and last is not None and count == output_len, count
        return (last - first) * 1e3 / (count - 1)

    async def main() -> list[float]:
        streams = [engine.stream(prompt, params) for prompt in prompts]
        return list(await asyncio.gather(*(read(stream) for stream in streams)))

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()
        print(f"engine thread: {spent[0] * 1e3 / max(spent[1], 1):.3f} ms per delivery of a tick's events")


def prefill_ticks(args: argparse.Namespace) -> None:
    """Host time of the ticks that carry prompt tokens (see the module docstring)."""
    rows = args.rows
    backend, core = stubbed_backend(rows, (args.prompt_len + args.prefix_len) // 16 + 40, sliding_window=512,
                                    max_position_embeddings=4096)
    mixed = backend.mixed
    freeze_startup_objects()  # as the engine does when it is built
    scheduler = ContinuousBatchScheduler(backend, core)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    shared = tuple((j * 13) % 400 + 4 for j in range(args.prefix_len))  # cached by the warm-up round
    for round_name in ("warm-up", "timed"):
        for i in range(rows):
            prompt = shared + tuple((i * 7 + j + len(round_name)) % 400 + 4 for j in range(args.prompt_len))
            scheduler.add_request(Request(f"{round_name}{i}", prompt, params))
        profile = cProfile.Profile() if args.profile and round_name == "timed" else None
        steps_before, tokens_before = mixed.steps, mixed.tokens
        if profile is not None:
            profile.enable()
        start = time.perf_counter()
        while scheduler.has_work:
            scheduler.step()
        elapsed = time.perf_counter() - start
        if profile is not None:
            profile.disable()
    ticks, tokens = mixed.steps - steps_before, mixed.tokens - tokens_before
    print(f"rows={rows} x {args.prompt_len} tokens: {ticks} prompt-carrying ticks of {tokens / ticks:.0f} tokens, "
          f"{elapsed / ticks * 1e3:.3f} ms host time per tick (decode-only ticks included in the total)"
          + (" (under cProfile)" if args.profile else ""))
    if args.profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
