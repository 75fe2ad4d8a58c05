"""Tensor parallel in custom_torch on the CPU (gloo, world size 2): greedy tokens equal tensor_parallel_size=1 and
transformers on tiny Gemma 4 / Gemma 3 checkpoints of shapes used nowhere else (a KV head replicated, KV heads
split, K=V with one global KV head, MoE experts split on their width, an untied head with a vocabulary that does
not divide by 2), through the scheduler and the offline LLM; clean shutdown, a dead worker, refused sizes.

A row-parallel all-reduce sums fp32 partials in another order than one matmul, so logits move in the last bits:
tokens are compared exactly, logits with a tolerance."""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures_backend import assert_matches_hf_generate, assert_no_leaks, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.errors import ConfigurationError
from gemmaserve.settings import CoreSettings
from gemmaserve_custom_torch.backend import CustomTorchBackend, check_tensor_parallel_settings
from gemmaserve_custom_torch.distributed.workers import TensorParallelWorkerError
from gemmaserve_custom_torch.settings import load_custom_settings
from tiny_checkpoints import build_tiny_gemma3, build_tiny_gemma4, build_tiny_gemma4_k_eq_v, build_tiny_gemma4_moe

SLIDING, FULL = "sliding_attention", "full_attention"

# Shapes chosen to differ from the tiny configs in the docs and the other tests.
_CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    # 6 query heads over 1 KV head (replicated on both ranks), PLE, 2 KV-shared layers with a double-wide MLP
    "dense_ple_shared": lambda path: build_tiny_gemma4(
        path, seed=11, hidden_size=48, num_attention_heads=6, num_key_value_heads=1, intermediate_size=96,
        num_hidden_layers=5, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, sliding_window=6),
    # K=V full layers with one global KV head (replicated), 2 sliding KV heads (split), no KV sharing
    "k_eq_v": lambda path: build_tiny_gemma4_k_eq_v(
        path, seed=12, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, intermediate_size=80,
        num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, use_double_wide_mlp=False),
    # dense MLP + 6 experts top 2 of width 24 (12 per rank), K=V with 2 global KV heads (split)
    "moe": lambda path: build_tiny_gemma4_moe(
        path, seed=13, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=2,
        num_experts=6, moe_intermediate_size=24, intermediate_size=48, num_hidden_layers=4,
        layer_types=[SLIDING, FULL, SLIDING, FULL]),
    # Gemma 3, untied LM head, vocabulary 515 (ranks hold 258 rows, one padded), 1 KV head
    "gemma3_untied": lambda path: build_tiny_gemma3(
        path, seed=14, hidden_size=56, num_attention_heads=4, num_key_value_heads=1, intermediate_size=112,
        vocab_size=515, tie_word_embeddings=False, num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL]),
}

# (prompt, arrival tick, max tokens): staggered arrivals, chunked prompts (chunk 16 > window), and an exact
# repeat of the first prompt after it finished: 22 tokens in blocks of 4, so storing it copies its partial tail
# block and the repeat reads that copy and writes its last position into it (copy-on-write): both copies must
# happen on the worker too
_PROMPT = [2, 17, 93, 311, 45, 8, 260, 77, 140, 5, 66, 402, 19, 230, 88, 301, 12, 150, 9, 480, 33, 61]
_REQUESTS = [(_PROMPT, 0, 12), ([2, 400, 7, 99, 123], 1, 9), (_PROMPT[:9] + [70, 71, 72], 3, 7), (_PROMPT, 40, 6)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tp_ckpts")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = _CHECKPOINTS[name](root / name)
        return built[name]

    return get


def _backend(path: Path, tensor_parallel_size: int, **custom: Any) -> CustomTorchBackend:
    core = CoreSettings(model=str(path), device="cpu", dtype="float32", kv_block_size=4, max_batch_size=8,
                        prefill_chunk_tokens=16, tensor_parallel_size=tensor_parallel_size)
    return CustomTorchBackend.from_checkpoint(path, "cpu", core, load_custom_settings(kv_blocks=96, **custom))


def _no_children_left() -> None:
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children(), multiprocessing.active_children()


def _prefill_logits(backend: CustomTorchBackend, prompt: list[int]) -> torch.Tensor:
    state = backend.prefill_lookup(prompt)
    backend.prefill_chunk(state, len(prompt))
    logits = state.last_logits.clone()
    backend.free_row_kv(state.kv)
    return logits


@pytest.mark.parametrize("name", list(_CHECKPOINTS))
def test_tensor_parallel_greedy_equals_single_rank_and_transformers(checkpoint, hf_reference, name: str) -> None:
    path = checkpoint(name)
    results = {}
    logits = {}
    for size in (1, 2):
        backend = _backend(path, size)
        copies: list[str] = []
        if size > 1:
            mirror = backend.pools.copy_listener
            assert mirror is not None

            def counted(group: str, sources: Any, targets: Any) -> None:
                copies.append(group)
                mirror(group, sources, targets)

            backend.pools.copy_listener = counted
        try:
            logits[size] = _prefill_logits(backend, _PROMPT[:7])
            backend.prefix_cache.clear()
            done = run_scheduler(backend, _REQUESTS)
            results[size] = {rid: request.output_token_ids for rid, request in done.items()}
            assert backend.prefix_cache.stats["hits"] >= 1  # the repeat was served from the cache
            assert size == 1 or len(copies) >= 2  # the tail copy and the copy-on-write reached the worker
            assert_no_leaks(backend)
        finally:
            backend.close()
    assert results[2] == results[1]
    torch.testing.assert_close(logits[2], logits[1], atol=1e-5, rtol=0)
    hf = hf_reference(path, torch.float32)
    for rid, (prompt, _, _) in zip(results[2], _REQUESTS):
        assert_matches_hf_generate(hf, prompt, results[2][rid])
    _no_children_left()


def test_offline_llm_with_tensor_parallel_size_2(checkpoint) -> None:
    from gemmaserve import LLM, SamplingParams

    path = checkpoint("dense_ple_shared")
    prompts = [_PROMPT, [2, 400, 7, 99, 123], _PROMPT[:11], [2, 5, 6, 7]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 5, 11, 3)]
    outputs = {}
    for size in (1, 2):
        with LLM(str(path), backend="custom-cpu", device="cpu", dtype="float32", tensor_parallel_size=size,
                 kv_block_size=4, prefill_chunk_tokens=8) as llm:
            workers = llm.engine.backend.workers
            assert (workers is not None and workers.tp.world_size == 2) if size == 2 else workers is None
            outputs[size] = [out.token_ids for out in llm.generate(prompts, params)]
            seeded = llm.generate([_PROMPT], SamplingParams(max_tokens=6, temperature=0.8, seed=5))
            outputs[size].append(seeded[0].token_ids)
            handles = []  # staggered in wall-clock time: each joins the running batch mid-flight
            for prompt in prompts:
                handles.append(llm.engine.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
                time.sleep(0.05)
            outputs[size] += [handle.result().token_ids for handle in handles]
    assert outputs[2] == outputs[1]
    assert [len(tokens) for tokens in outputs[2]] == [8, 5, 11, 3, 6, 10, 10, 10, 10]
    _no_children_left()


def test_close_stops_the_workers_and_a_dead_worker_fails_loudly(checkpoint) -> None:
    path = checkpoint("k_eq_v")
    backend = _backend(path, 2)
    workers = backend.workers
    assert workers is not None
    processes = list(workers.processes)
    assert all(process.is_alive() for process in processes)
    backend.close()
    assert all(process.exitcode == 0 for process in processes)
    _no_children_left()

    backend = _backend(path, 2)
    try:
        assert backend.workers is not None and backend.failure() is None
        victim = backend.workers.processes[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        failure = backend.failure()  # what /health reports, before any request
        assert failure is not None and "worker rank 1 exited with code -9" in failure
        started = time.monotonic()
        with pytest.raises(TensorParallelWorkerError, match=r"worker rank 1 exited with code -9"):
            _prefill_logits(backend, [2, 3, 4, 5])
        with pytest.raises(TensorParallelWorkerError, match="restart the engine"):  # and stays failed
            _prefill_logits(backend, [2, 3, 4, 5])
        assert time.monotonic() - started < 10
    finally:
        backend.close()
    _no_children_left()


_ENGINE_SCRIPT = """
import sys, time
from gemmaserve.settings import CoreSettings
from gemmaserve_custom_torch.backend import CustomTorchBackend
from gemmaserve_custom_torch.settings import load_custom_settings

if __name__ == "__main__":
    path = sys.argv[1]
    core = CoreSettings(model=path, device="cpu", dtype="float32", tensor_parallel_size=2)
    backend = CustomTorchBackend.from_checkpoint(path, "cpu", core, load_custom_settings(kv_blocks=32))
    print(backend.workers.processes[0].pid, backend.workers.rendezvous_file, flush=True)
    time.sleep(120)
"""


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_killed_engine_process_leaves_no_worker_behind(checkpoint, tmp_path) -> None:
    """SIGKILL of the engine process (no close): the worker sees its pipe close and exits by itself, removing the
    rendezvous file the engine's close would have removed."""
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    engine = subprocess.Popen([sys.executable, str(script), str(checkpoint("k_eq_v"))], stdout=subprocess.PIPE,
                              text=True)
    try:
        line = engine.stdout.readline() if engine.stdout else ""
        pid, _, rendezvous = line.strip().partition(" ")
        assert pid.isdigit(), f"engine script printed {line!r}"
        worker = int(pid)
        assert _running(worker) and Path(rendezvous).exists()
    finally:
        engine.kill()
        engine.wait(10)
    deadline = time.monotonic() + 15
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker), f"worker {worker} outlived its engine process"
    assert not Path(rendezvous).exists(), "the rendezvous file outlived the engine and its worker"


_ENGINE_DIES_AT_RENDEZVOUS = """
import multiprocessing, sys, time
import torch
from gemmaserve_custom_torch.distributed import workers

def stuck(*args, **kwargs):  # rank 0 stops before the rendezvous (killed during start-up)
    print(multiprocessing.active_children()[0].pid, flush=True)
    time.sleep(120)

if __name__ == "__main__":
    workers.init_tensor_parallel = stuck
    workers.TensorParallelWorkers.start(sys.argv[1], "cpu", torch.float32, 2)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_an_engine_killed_during_start_up_leaves_no_worker_behind(checkpoint, tmp_path) -> None:
    """SIGKILL of the engine process while its worker waits at the rendezvous (or loads its shard): the worker
    reads no pipe then, so it watches its parent and exits (it waited out the 300 s rendezvous timeout)."""
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_DIES_AT_RENDEZVOUS)
    engine = subprocess.Popen([sys.executable, str(script), str(checkpoint("k_eq_v"))], stdout=subprocess.PIPE,
                              text=True)
    try:
        line = engine.stdout.readline() if engine.stdout else ""
        assert line.strip().isdigit(), f"engine script printed {line!r}"
        worker = int(line)
        time.sleep(0.5)  # the worker enters the rendezvous
        assert _running(worker)
    finally:
        engine.kill()
        engine.wait(10)
    deadline = time.monotonic() + 15
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker), f"worker {worker} outlived its engine process"


def test_a_worker_that_cannot_be_spawned_leaves_no_other_worker_or_file(checkpoint, monkeypatch) -> None:
    """Spawning rank 2 fails (say EAGAIN: no more processes): rank 1, already started, is closed and the
    rendezvous file removed (the file was left behind; rank 1 ended only when it found its pipe collected)."""
    import tempfile

    from gemmaserve_custom_torch.distributed import workers as workers_module

    real = workers_module.torch_mp.get_context("spawn")
    made: list[str] = []

    class OneProcessOnly:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (multiprocessing's name)
            made.append(kwargs["name"])
            if len(made) == 2:
                raise OSError(11, "Resource temporarily unavailable")
            return real.Process(*args, **kwargs)

    monkeypatch.setattr(workers_module.torch_mp, "get_context", lambda method: OneProcessOnly())
    files = set(Path(tempfile.gettempdir()).glob("gemmaserve-tp-*.rendezvous"))
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        workers_module.TensorParallelWorkers.start(str(checkpoint("k_eq_v")), "cpu", torch.float32, 3)
    assert made == ["gemmaserve-tp-rank1", "gemmaserve-tp-rank2"]
    _no_children_left()
    assert set(Path(tempfile.gettempdir()).glob("gemmaserve-tp-*.rendezvous")) <= files


def test_a_failed_rank0_forward_stops_the_backend_instead_of_desynchronising(checkpoint, monkeypatch) -> None:
    """Rank 0 raising inside a tick the worker already runs would leave the worker in a collective rank 0 never
    joins: the next collective would pair with the wrong one. The backend refuses every later forward instead."""
    backend = _backend(checkpoint("k_eq_v"), 2)
    try:
        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("injected rank 0 failure")

        monkeypatch.setattr(backend.mixed, "forward_tick", broken)
        with pytest.raises(RuntimeError, match="injected"):
            _prefill_logits(backend, [2, 3, 4, 5])
        assert "ranks are out of step" in (backend.failure() or "")
        monkeypatch.undo()
        with pytest.raises(TensorParallelWorkerError, match="out of step"):
            _prefill_logits(backend, [2, 3, 4, 5])
    finally:
        backend.close()
    _no_children_left()


def test_invalid_sizes_and_unsupported_backends_are_refused(checkpoint) -> None:
    from gemmaserve import LLM

    path = checkpoint("k_eq_v")  # 4 query heads
    with pytest.raises(ConfigurationError, match=r"TENSOR_PARALLEL_SIZE=3 cannot shard.*num_attention_heads=4 is "
                                                 r"not divisible by 3.*\(this model: 1, 2(, 4)?\)"):
        LLM(str(path), backend="custom-cpu", device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigurationError, match=r"backend 'hf' does not support tensor parallel"):
        LLM(str(path), backend="hf", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        CoreSettings(tensor_parallel_size=0)
    with pytest.raises(ConfigurationError, match="CUSTOM_BACKEND_CUDA_GRAPH=0"):
        check_tensor_parallel_settings(load_custom_settings(), "cuda")
    with pytest.raises(ConfigurationError, match="CUSTOM_BACKEND_COMPILE.*CUSTOM_BACKEND_PREFILL_ATTENTION=sdpa"):
        check_tensor_parallel_settings(load_custom_settings(compile=True, prefill_attention="sdpa"), "cpu")
    check_tensor_parallel_settings(load_custom_settings(cuda_graph=False), "cuda")
    _no_children_left()


def test_a_device_index_other_than_0_is_refused_not_ignored(checkpoint) -> None:
    """Ranks run on cuda:0..N-1 whatever DEVICE names: DEVICE=cuda:1 silently put rank 0 on cuda:0."""
    from gemmaserve_custom_torch.distributed.workers import TensorParallelWorkers

    with pytest.raises(ConfigurationError, match=r"DEVICE=cuda:1.*CUDA_VISIBLE_DEVICES"):
        TensorParallelWorkers.start(str(checkpoint("k_eq_v")), "cuda:1", torch.float32, 2)
    _no_children_left()


def test_fused_projections_on_both_ranks_keep_the_tokens(checkpoint) -> None:
    """CUSTOM_BACKEND_FUSE=on: rank 0 and the worker each fuse their q/k/v and gate/up slices at load."""
    path = checkpoint("dense_ple_shared")
    requests = _REQUESTS[:2]
    results = []
    for size, fuse in ((1, "off"), (2, "on")):
        backend = _backend(path, size, fuse=fuse)
        try:
            results.append({rid: r.output_token_ids for rid, r in run_scheduler(backend, requests).items()})
        finally:
            backend.close()
    assert results[1] == results[0]
    _no_children_left()


def _kv_heads(config: Any, name: str) -> int:
    return config.num_kv_heads[int(name.split(".")[1])]


def test_shards_are_read_as_slices_of_the_checkpoint(checkpoint) -> None:
    """read_shard(shard_for(...)) equals slicing the full tensor: MoE gate/up halves, row- and column-parallel
    weights, replicated KV heads, and a zero-padded vocabulary shard."""
    from safetensors import safe_open

    from gemmaserve_custom_torch.distributed.shards import read_shard, shard_for
    from gemmaserve_custom_torch.models.config import GemmaTextConfig

    for name in ("moe", "gemma3_untied"):
        path = checkpoint(name)
        config = GemmaTextConfig.from_pretrained(path)
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                local = key.removeprefix("model.")
                full = f.get_tensor(key)
                parts = [read_shard(f, key, shard_for(local, config, rank, 2)) for rank in (0, 1)]
                if local.endswith("experts.gate_up_proj"):
                    width = config.moe_intermediate_size // 2
                    gate = torch.cat([p[:, :width] for p in parts], dim=1)
                    up = torch.cat([p[:, width:] for p in parts], dim=1)
                    assert torch.equal(torch.cat([gate, up], dim=1), full)
                elif local.endswith(("k_proj.weight", "v_proj.weight")) and _kv_heads(config, local) == 1:
                    assert torch.equal(parts[0], full) and torch.equal(parts[1], full)  # one KV head: replicated
                elif local in ("embed_tokens.weight", "lm_head.weight"):  # 515 rows: 258 + 257 and one zero row
                    rows = -(-full.shape[0] // 2)
                    assert parts[0].shape == parts[1].shape == (rows, full.shape[1])
                    assert torch.equal(torch.cat(parts)[: full.shape[0]], full)
                    assert full.shape[0] % 2 == 0 or not parts[1][-1].any()
                else:
                    dim = next((d for d in range(full.dim()) if parts[0].shape[d] != full.shape[d]), None)
                    if dim is None:
                        assert torch.equal(parts[0], full) and torch.equal(parts[1], full)  # replicated
                    else:
                        assert torch.equal(torch.cat(parts, dim=dim), full), key


def test_a_terminal_interrupt_reaching_a_worker_does_not_kill_it(checkpoint) -> None:
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group, workers included, while the
    server drains its running requests: a worker must live on until rank 0 closes it (it did die with
    KeyboardInterrupt, failing every request still being drained)."""
    backend = _backend(checkpoint("k_eq_v"), 2)
    try:
        assert backend.workers is not None
        expected = _prefill_logits(backend, [2, 3, 4, 5])
        victim = backend.workers.processes[0]
        os.kill(victim.pid, signal.SIGINT)
        victim.join(2.0)
        assert victim.exitcode is None and backend.failure() is None
        torch.testing.assert_close(_prefill_logits(backend, [2, 3, 4, 5]), expected, atol=1e-5, rtol=0)
    finally:
        backend.close()
    assert victim.exitcode == 0
    _no_children_left()


@pytest.mark.parametrize("overrides", [{"tensor_parallel_size": 2}, {"enable_expert_parallel": True}])
def test_auto_selection_passes_over_backends_without_the_parallelism_asked_for(overrides: dict) -> None:
    """BACKEND=auto with tensor or expert parallel on the CPU: hf (first by priority) cannot split the model, so
    selection takes custom-cpu instead of choosing hf and refusing."""
    from gemmaserve.selection import select_backend

    chosen = select_backend(CoreSettings(device="cpu", backend="auto", **overrides))
    assert chosen.spec.name == "custom-cpu"
    assert "does not support" in chosen.rejected["hf"] and "custom-cpu" in chosen.rejected["hf"]


class _GoneProcess:
    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode

    def join(self, timeout: float | None = None) -> None:
        pass


class _Pipe:
    def __init__(self, *messages: tuple[Any, ...]) -> None:
        self.messages = list(messages)

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.messages)

    def recv(self) -> tuple[Any, ...]:
        return self.messages.pop(0)


def test_a_failed_forward_names_the_killed_rank_not_the_ones_its_death_broke() -> None:
    """Rank 2 was killed; rank 1's collective broke with it and rank 1 exited with its own (gloo) error first in
    rank order: the record names rank 2 and lists rank 1 after it (at world size 3 it named rank 1, or no rank)."""
    from gemmaserve_custom_torch.distributed.workers import TensorParallelWorkers

    reset = ("error", "RuntimeError: gloo pair.cc: Connection reset by peer")
    processes: list[Any] = [_GoneProcess(1), _GoneProcess(-9)]
    workers = TensorParallelWorkers(None, processes, [_Pipe(reset), _Pipe()], "/nonexistent")  # type: ignore[arg-type]
    workers.forward_failed(RuntimeError("rank 0's collective: Connection reset by peer"))
    assert workers.failure is not None
    assert workers.failure.startswith("tensor-parallel worker rank 2 exited with code -9 (after it: rank 1 exited "
                                      "with code 1)")
    processes = [_GoneProcess(1)]
    pipes = [_Pipe(("error", "ValueError: bad shard"))]
    workers = TensorParallelWorkers(None, processes, pipes, "/nonexistent")  # type: ignore[arg-type]
    workers.forward_failed(RuntimeError("broken pipe"))
    assert "rank 1 exited with code 1; its error: ValueError: bad shard" in (workers.failure or "")


def test_closing_with_a_hung_worker_interrupts_it_instead_of_waiting_out_the_collective(checkpoint,
                                                                                     monkeypatch) -> None:
    """A worker that stops (SIGSTOP) mid-run holds rank 0 in a collective until its 300 s timeout: close waits
    ``Engine.INTERRUPT_AFTER_S`` (1 s here), then the backend kills the workers, the collective breaks and the
    engine ends; the running request ends with an error, no process is left."""
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.engine.engine import Engine

    monkeypatch.setattr(Engine, "INTERRUPT_AFTER_S", 1.0)
    llm = LLM(str(checkpoint("k_eq_v")), backend="custom-cpu", device="cpu", dtype="float32", tensor_parallel_size=2,
              kv_block_size=4, prefill_chunk_tokens=8)
    worker = llm.engine.backend.workers.processes[0]
    try:
        decoding = threading.Event()
        handle = llm.engine.submit(_PROMPT, SamplingParams(max_tokens=400, ignore_eos=True),
                                   on_event=lambda event: decoding.set() if event.new_token_ids else None)
        assert decoding.wait(30)
        os.kill(worker.pid, signal.SIGSTOP)
        time.sleep(0.5)  # rank 0 now waits in a collective
        started = time.monotonic()
        llm.close()
        assert time.monotonic() - started < 8
        assert handle.result(timeout=5).finish_reason in ("error", "cancelled")
    finally:
        if worker.exitcode is None:
            os.kill(worker.pid, signal.SIGKILL)
        llm.close()
    _no_children_left()


def test_a_second_tensor_parallel_engine_in_one_process_is_refused_before_spawning(checkpoint) -> None:
    """One torch.distributed group per process: a second tensor-parallel backend is a ConfigurationError at once
    (no worker spawned, no rendezvous file), and the first keeps serving."""
    path = checkpoint("k_eq_v")
    first = _backend(path, 2)
    try:
        children = set(multiprocessing.active_children())
        files = set(Path(tempfile.gettempdir()).glob("gemmaserve-tp-*.rendezvous"))
        started = time.monotonic()
        with pytest.raises(ConfigurationError, match="already belongs to a torch.distributed group"):
            _backend(path, 2)
        assert time.monotonic() - started < 5
        assert set(multiprocessing.active_children()) == children
        assert set(Path(tempfile.gettempdir()).glob("gemmaserve-tp-*.rendezvous")) == files
        _prefill_logits(first, [2, 3, 4, 5])
    finally:
        first.close()
    _no_children_left()


def test_a_config_that_disagrees_with_the_weights_is_refused_at_every_size(checkpoint, tmp_path) -> None:
    """Each rank reads the slices config.json implies, which always fit the sharded model: the check that the
    checkpoint's tensors have the sizes config.json gives compares the whole tensors (a halved intermediate_size
    loaded silently at tensor_parallel_size 2 and served nonsense)."""
    import json
    import shutil

    from gemmaserve.errors import ModelLoadError

    path = tmp_path / "mismatched"
    shutil.copytree(checkpoint("gemma3_untied"), path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] //= 2
    (path / "config.json").write_text(json.dumps(config))
    for size in (1, 2):
        with pytest.raises(ModelLoadError, match="config.json disagrees with the weights.*down_proj"):
            _backend(path, size)
    _no_children_left()


_NO_CLOSE_SCRIPT = """
import sys
from gemmaserve import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], backend="custom-cpu", device="cpu", dtype="float32", tensor_parallel_size=2)
    print(llm.engine.backend.workers.rendezvous_file, flush=True)
    llm.generate([[2, 5, 6]], SamplingParams(max_tokens=2))
    raise SystemExit(0)  # no close(), no `with`
"""


def test_an_engine_that_exits_without_close_removes_its_rendezvous_file(checkpoint, tmp_path) -> None:
    """A process that ends without closing its tensor-parallel LLM (no ``with``, an uncaught exception) still
    stops the workers and removes the rendezvous file (multiprocessing's exit handler killed the workers first,
    so neither they nor close() removed it)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "no_close.py"
    script.write_text(_NO_CLOSE_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(checkpoint("k_eq_v"))], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    rendezvous = done.stdout.split()[0]
    assert rendezvous.endswith(".rendezvous") and not Path(rendezvous).exists()
