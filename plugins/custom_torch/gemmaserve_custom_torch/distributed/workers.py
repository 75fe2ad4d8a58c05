"""Ranks 1..N-1 of a tensor-parallel custom_torch backend: worker processes that replay rank 0's ticks.

Process layout. The engine process is rank 0: it owns scheduling, block tables, the prefix cache, admission
and sampling. :meth:`TensorParallelWorkers.start` spawns ranks 1..N-1 (torch.multiprocessing, ``spawn``); each
joins the process group, loads only its weight shard, and once rank 0 has sized the KV pools builds pools with
the same block counts (a block or slot id means the same on every rank) and a `MixedStep` of its own. A worker
never allocates a block: every id it uses comes from rank 0.

Rank 0 -> worker messages, one duplex pipe per worker, handled in order:

- ``("pools", num_blocks, block_size, attention, fast_prefill, fuse)``: build pools and the tick runner;
  the worker answers ``("ready",)``;
- ``("forward", tick)``: run the forward of a `PackedTick` (`MixedStep.forward_tick`); its collectives pair
  up with rank 0's forward of the same tick, which rank 0 starts right after sending;
- ``("copy", group, sources, targets)``: copy K/V blocks (copies made outside a forward: the prefix cache's
  tail copies and copy-on-write), read all sources before writing any target;
- ``("close",)``: leave the group and exit.

Worker -> rank 0: ``("started",)``, ``("loaded",)``, ``("ready",)``, and ``("error", text)`` right before a
worker exits on any exception. A worker exits when rank 0's process ends, whatever it is doing (it
watches its parent: at the rendezvous or while loading it reads no pipe). Rank 0 checks that every worker
lives before each message and raises `TensorParallelWorkerError` (naming the rank, its exit code and its error)
when one does not; from then on the backend refuses every forward. A worker dying inside a collective makes
rank 0's collective fail (its connection closes) rather than hang; `collectives.COLLECTIVE_TIMEOUT` bounds
anything else.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
import os
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as torch_mp

from gemmaserve.errors import BackendStepError, ConfigurationError

from .collectives import TensorParallel, close_tensor_parallel, init_tensor_parallel

if TYPE_CHECKING:
    from ..kv.forward_batch import PackedTick

__all__ = ["TensorParallelWorkerError", "TensorParallelWorkers", "rank_device"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""Seconds a spawned worker gets to import torch and report itself."""
LOAD_TIMEOUT_S = 3600.0
"""Seconds a worker gets to load its shard or build its pools (a large checkpoint from a slow disk)."""
CLOSE_TIMEOUT_S = 10.0
"""Seconds a worker gets to exit after ``close`` before it is terminated (then killed); 1 s after a failure (a
worker may then be stuck in a collective rank 0 will never join)."""
FAILURE_SETTLE_S = 1.0
"""How long a failed forward waits for the other ranks' failures to show before naming the cause."""


class TensorParallelWorkerError(BackendStepError):
    """A tensor-parallel worker process died or failed; the backend cannot run forwards any more."""


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """The device of ``rank``: ``cuda:<rank>`` when the engine runs on CUDA, else the engine's device."""
    device = torch.device(device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1 (see the module docstring). Build with :meth:`start`; the backend owns
    it and calls :meth:`close`. Not thread-safe (the backend lock)."""

    def __init__(self, tp: TensorParallel, processes: list[BaseProcess], pipes: list[mp_connection.Connection],
                 rendezvous_file: str) -> None:
        self.tp = tp
        self.processes = processes
        self.pipes = pipes
        self.rendezvous_file = rendezvous_file
        self.failure: str | None = None  # set once a worker is found dead or failed; every later send raises it
        self.closed = False
        self.joined = False  # this process joined the group (close leaves it)

    @classmethod
    def start(cls, model_path: str, device: str | torch.device, dtype: torch.dtype,
              world_size: int, quantization: str | None = None, expert_parallel: bool = False) -> TensorParallelWorkers:
        """Spawn ranks 1..``world_size``-1 (each loads ``model_path``'s shard in ``dtype`` on its device, FP8 with
        ``quantization="fp8"`` or an FP8 checkpoint, as ``GemmaForCausalLM.from_hf``; whole MoE experts per rank
        with ``expert_parallel``) and
        join the process group as rank 0. Returns once the group is formed; the workers' loading goes on (see
        :meth:`wait_loaded`). Raises TensorParallelWorkerError if a worker dies or fails to start."""
        engine_device = torch.device(device)
        if engine_device.type not in ("cpu", "cuda"):
            raise ConfigurationError(f"TENSOR_PARALLEL_SIZE > 1 runs on CPU (gloo) or CUDA (NCCL), not on "
                                     f"{engine_device.type}; set TENSOR_PARALLEL_SIZE=1")
        if engine_device.type == "cuda" and engine_device.index not in (None, 0):
            raise ConfigurationError(f"DEVICE={engine_device} with TENSOR_PARALLEL_SIZE={world_size}: the ranks run on "
                                     f"cuda:0..cuda:{world_size - 1}; set DEVICE=cuda and choose the GPUs with "
                                     "CUDA_VISIBLE_DEVICES")
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # before any worker is spawned
            raise ConfigurationError("this process already belongs to a torch.distributed group (another "
                                     "tensor-parallel engine is open here): close it first, or run this one in "
                                     "another process")
        if engine_device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ConfigurationError(f"TENSOR_PARALLEL_SIZE={world_size} needs {world_size} visible GPUs, "
                                     f"{torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES)")
        handle, rendezvous_file = tempfile.mkstemp(prefix="gemmaserve-tp-", suffix=".rendezvous")
        os.close(handle)
        context = torch_mp.get_context("spawn")
        processes: list[BaseProcess] = []
        pipes: list[mp_connection.Connection] = []
        dtype_name = str(dtype).removeprefix("torch.")
        workers = cls(TensorParallel(0, world_size), processes, pipes, rendezvous_file)
        try:
            for rank in range(1, world_size):
                ours, theirs = context.Pipe(duplex=True)
                pipes.append(ours)
                try:
                    process = context.Process(
                        target=run_worker, name=f"gemmaserve-tp-rank{rank}", daemon=True,
                        args=(rank, world_size, rendezvous_file, str(model_path), str(rank_device(device, rank)),
                              dtype_name, torch.get_num_threads(), quantization, expert_parallel, theirs),
                    )
                    process.start()
                finally:
                    theirs.close()
                processes.append(process)
            # registered after the spawns, so it runs before multiprocessing's own exit handler (atexit is LIFO),
            # which would terminate the daemon workers first: a process that ends without close() (no `with`, an
            # uncaught exception) still stops them and removes the rendezvous file
            atexit.register(workers.close)
            workers._expect("started", START_TIMEOUT_S)
            workers.tp = init_tensor_parallel(0, world_size, rendezvous_file, rank_device(device, 0),
                                              expert_parallel)
            workers.joined = True
        except BaseException:  # a failed spawn too: no started worker, pipe or rendezvous file is left
            workers.close()
            raise
        logger.info("custom_torch: tensor parallel over %d ranks (%s)%s, worker pids %s", world_size,
                    "nccl" if engine_device.type == "cuda" else "gloo",
                    ", MoE experts split whole (expert parallel)" if expert_parallel else "",
                    [p.pid for p in processes])
        return workers

    # -- rank 0 -> workers ---------------------------------------------------------------------------
    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard (raises TensorParallelWorkerError with its error)."""
        self._expect("loaded", LOAD_TIMEOUT_S)

    def build_pools(self, num_blocks: dict[str, int], block_size: int, attention: str, fast_prefill: bool,
                    fuse: bool) -> None:
        """Have every worker build KV pools of ``num_blocks`` (rank 0's counts) and its tick runner; waits."""
        self._send(("pools", dict(num_blocks), block_size, attention, fast_prefill, fuse))
        self._expect("ready", LOAD_TIMEOUT_S)

    def send_forward(self, tick: PackedTick) -> None:
        """Start the forward of ``tick`` on every worker (rank 0 runs its own right after; nothing waits)."""
        self._send(("forward", tick))

    def forward_failed(self, error: BaseException) -> None:
        """Rank 0's forward of the tick last sent raised: a dead or failed worker explains it (recorded as such);
        otherwise the workers may be waiting in a collective rank 0 never reached, so the ranks are out of step and
        every later forward is refused (a later collective would pair with the wrong one).

        One rank's death breaks the others' collectives too, and they fail a moment later: the failures get
        ``FAILURE_SETTLE_S`` to show, then the record names the rank most likely the cause (killed by a signal,
        else exited, else the first that reported an error) and lists every rank found dead."""
        if self.failure is not None:
            return
        deadline = time.monotonic() + FAILURE_SETTLE_S
        while True:
            pending = [w for p, pipe in zip(self.processes, self.pipes) if p.exitcode is None and not pipe.poll()
                       for w in (p.sentinel, pipe)]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0 or not mp_connection.wait(pending, remaining):
                break
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]
        reported = [rank for rank, pipe in enumerate(self.pipes, start=1) if pipe.poll()]
        killed = [rank for rank, code in dead if code is not None and code < 0]
        culprit = (killed or [rank for rank, _ in dead] or reported or [None])[0]
        if culprit is None:
            self.failure = (f"rank 0's forward of a tick raised after the workers started it ({type(error).__name__}: "
                            f"{error}); the ranks are out of step: restart the engine")
            return
        code = self.processes[culprit - 1].exitcode
        others = ", ".join(f"rank {rank} exited with code {c}" for rank, c in dead if rank != culprit)
        self._fail(culprit, ("failed" if code is None else f"exited with code {code}")
                   + (f" (after it: {others})" if others else ""))

    def send_copy(self, group: str, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy blocks ``sources[i]`` -> ``targets[i]`` of ``group`` on every worker, as rank 0 just did."""
        self._send(("copy", group, list(sources), list(targets)))

    def check(self) -> None:
        """Raise TensorParallelWorkerError if a worker has died or failed (now or before)."""
        if self.failure is None:
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode is not None:
                    self._fail(rank, f"exited with code {process.exitcode}")
                    break
        if self.failure is not None:
            raise TensorParallelWorkerError(self.failure)

    def failure_reason(self) -> str | None:
        """The recorded failure, or the first worker found dead now (not recorded: reads no pipe, so any thread
        may call it while the engine thread sends); None while every worker lives."""
        if self.failure is not None:
            return self.failure
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"tensor-parallel worker rank {rank} exited with code {process.exitcode}"
        return None

    def kill(self) -> None:
        """Kill every worker now (any thread; the backend lock not needed): a collective rank 0 waits in then
        fails, and the next forward reports the dead ranks. :meth:`close` still owes the cleanup."""
        for process in self.processes:
            if process.exitcode is None:
                process.kill()

    def close(self) -> None:
        """Tell every worker to exit, wait for them (terminate, then kill, stragglers), leave the group and
        remove the rendezvous file. Idempotent (also registered to run at interpreter exit, see :meth:`start`)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        for pipe in self.pipes:
            try:
                pipe.send(("close",))
            except (OSError, ValueError):
                pass  # already gone
        deadline = time.monotonic() + (CLOSE_TIMEOUT_S if self.failure is None else 1.0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
        for pipe in self.pipes:
            pipe.close()
        if self.joined:
            close_tensor_parallel()
        try:
            os.unlink(self.rendezvous_file)
        except OSError:
            pass

    # -- internals -------------------------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        if self.closed:
            raise TensorParallelWorkerError("the tensor-parallel workers were closed with the backend")
        self.check()
        payload = bytes(ForkingPickler.dumps(message))  # pickled once for every worker (what Connection.send does)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(payload)
            except (OSError, ValueError) as exc:
                self._fail(rank, f"stopped reading its messages ({type(exc).__name__}: {exc})")
                raise TensorParallelWorkerError(self.failure) from None

    def _expect(self, answer: str, timeout: float) -> None:
        """Wait for ``answer`` from every worker; raise on an ``error`` message, a death or the timeout."""
        deadline = time.monotonic() + timeout
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), start=1):
            while True:
                ready = mp_connection.wait([pipe, process.sentinel], max(0.0, deadline - time.monotonic()))
                if pipe in ready:
                    try:
                        message = pipe.recv()
                    except EOFError:
                        process.join(5.0)
                        self._fail(rank, f"exited with code {process.exitcode}")
                        raise TensorParallelWorkerError(self.failure) from None
                    if message[0] == answer:
                        break
                    if message[0] == "error":
                        self.failure = f"tensor-parallel worker rank {rank} failed: {message[1]}"
                        raise TensorParallelWorkerError(self.failure)
                    raise TensorParallelWorkerError(f"tensor-parallel worker rank {rank} answered {message[0]!r}, "
                                                    f"expected {answer!r}")
                if process.sentinel in ready:
                    process.join(5.0)
                    self._fail(rank, f"exited with code {process.exitcode}")
                    raise TensorParallelWorkerError(self.failure)
                if not ready:
                    self._fail(rank, f"did not answer {answer!r} within {timeout:.0f} s")
                    raise TensorParallelWorkerError(self.failure)

    def _fail(self, rank: int, what: str) -> None:
        """Record the first failure, with the worker's own error message when it sent one."""
        if self.failure is not None:
            return
        detail = ""
        pipe = self.pipes[rank - 1]
        try:
            while pipe.poll():
                message = pipe.recv()
                if message[0] == "error":
                    detail = f"; its error: {message[1]}"
        except (EOFError, OSError):
            pass
        self.failure = (f"tensor-parallel worker rank {rank} {what}{detail}; the backend cannot run forwards any "
                        "more: restart the engine")


def run_worker(rank: int, world_size: int, rendezvous_file: str, model_path: str, device: str, dtype_name: str,
               num_threads: int, quantization: str | None, expert_parallel: bool,
               pipe: mp_connection.Connection) -> None:
    """A worker process's main (rank ``rank``): join the group, load the shard, then serve rank 0's messages
    until ``close`` or until rank 0's end of the pipe closes. Any exception is sent to rank 0, then the worker
    exits with code 1. SIGINT is ignored: a terminal's Ctrl-C reaches the whole process group, and rank 0 (which
    drains its running requests first) decides when the worker exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel, rendezvous_file), name="gemmaserve-tp-parent-watch",
                         daemon=True).start()
    from ..kv.pools import KVPools
    from ..mixed_step import MixedStep
    from ..models.gemma import GemmaForCausalLM

    code = 0
    try:
        torch.set_num_threads(num_threads)
        if torch.device(device).type == "cuda":  # a broken GPU fails here, reported, before rank 0 waits to join
            torch.cuda.set_device(device)
            torch.empty(1, device=device)
        pipe.send(("started",))
        tp = init_tensor_parallel(rank, world_size, rendezvous_file, torch.device(device), expert_parallel)
        dtype = getattr(torch, dtype_name)
        model = GemmaForCausalLM.from_hf(model_path, device=device, dtype=dtype, tp=tp, quantization=quantization)
        pipe.send(("loaded",))
        op, num_blocks, block_size, attention, fast_prefill, fuse = pipe.recv()
        if op != "pools":
            raise RuntimeError(f"expected the 'pools' message first, got {op!r}")
        if fuse:
            from ..backend import fuse_model

            fuse_model(model)
        pools = KVPools(model.config, num_blocks, block_size, dtype, device)
        mixed = MixedStep(model, pools, attention, fast_prefill=fast_prefill)
        pipe.send(("ready",))
        with torch.inference_mode():
            while True:
                message = pipe.recv()
                if message[0] == "forward":
                    mixed.forward_tick(message[1])
                elif message[0] == "copy":
                    _, group, sources, targets = message
                    pools.copy_blocks(group, sources, targets)
                elif message[0] == "close":
                    break
                else:
                    raise RuntimeError(f"unknown message {message[0]!r}")
    except EOFError:
        pass  # rank 0 is gone: nothing left to serve
    except BaseException:
        code = 1
        try:
            pipe.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except (OSError, ValueError):
            pass
    finally:
        close_tensor_parallel()
    if code:
        raise SystemExit(code)


def _exit_with(parent_sentinel: int, rendezvous_file: str) -> None:
    """A worker's watchdog thread: exit the process at once when rank 0's process ends (no cleanup is owed to a
    group whose rank 0 is gone; the OS releases the device memory), removing the rendezvous file rank 0's
    ``close`` would have removed (every worker tries; the first wins)."""
    mp_connection.wait([parent_sentinel])
    try:
        os.unlink(rendezvous_file)
    except OSError:
        pass
    os._exit(1)
