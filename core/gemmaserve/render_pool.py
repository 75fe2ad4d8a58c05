"""Chat templates rendered and prompts tokenized in worker processes, off the server's GIL.

Rendering a Jinja chat template and turning the tokenizer's output into Python lists hold the GIL, so on the
server's preparation threads they take it from the event loop (every open stream) and the engine thread. A
:class:`RenderPool` runs that work in a few worker processes instead: ``python -m gemmaserve.render_pool``
children (not multiprocessing: nothing of the server's ``__main__`` is re-run, and nothing is forked from a
process with threads and torch). Each worker gets a pickled copy of the server's tokenizer adapter, chat template
included, and runs the very same :meth:`~gemmaserve.hf_tokenizer.HFTokenizerAdapter.apply_chat_template` /
``encode``, so the token ids are those an in-process call returns. Workers import transformers' tokenizer module,
never torch, and run at a lower CPU priority (:data:`RENDER_WORKER_NICE`).

Who runs what: the HTTP app (:func:`gemmaserve.server.app.create_app`) owns one pool; its lifespan calls
:meth:`RenderPool.start` (workers spawn on a background thread) and :meth:`RenderPool.close`. A pool used before
``start`` (an app served without its lifespan) starts itself. Calls block the calling thread (a preparation
thread, never the event loop) until a worker answers. A worker that dies during a call is replaced and the call
retried once on the replacement; a second death raises :class:`RenderWorkerDied`. Exceptions the tokenizer raises
(``InvalidRequestError`` for a template that rejects the messages) come back as they are.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

__all__ = ["RenderPool", "RenderWorkerDied", "default_render_processes", "RENDER_POOL_MIN_CHARS", "RENDER_WORKER_NICE"]

logger = logging.getLogger(__name__)

RENDER_POOL_MIN_CHARS = 4096
"""Chats whose message text (or prompts whose text) is shorter than this stay in-process: their render and
tokenization hold the GIL for well under a millisecond, less than the pool's round trip costs."""

RENDER_WORKER_NICE = 10
"""Workers run at this lower CPU priority: where cores are short, the event loop and the engine thread (latency:
open streams) get the CPU before preparation (throughput). Measured with ``benchmarks/loop_stall.py 200 30000``
on 2 busy cores: stream median gap 16 ms instead of 30-36 ms, total event-loop lag about halved."""

_READY = "ready"


class RenderWorkerDied(RuntimeError):
    """A render worker process died twice while running one call (both have been replaced)."""


def default_render_processes() -> int:
    """``RENDER_PROCESSES`` unset (-1): min(4, CPU count)."""
    return max(1, min(4, os.cpu_count() or 1))


class _Worker:
    """One child process and its pipes; used by one thread at a time. ``generation``: the pool opening it
    was started for (a worker of an earlier opening is stopped when it comes back, never queued)."""

    def __init__(self, payload: bytes, generation: int) -> None:
        self.generation = generation
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # its own session: a terminal's Ctrl-C (SIGINT to the foreground process group) must not kill a worker
        # while the server drains; the pool ends it by closing its stdin, and its stdin closes if the server dies
        self.process = subprocess.Popen([sys.executable, "-m", "gemmaserve.render_pool"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, start_new_session=True)
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin: IO[bytes] = self.process.stdin
        self._stdout: IO[bytes] = self.process.stdout
        if self.call(payload, pickled=True) != _READY:
            self.kill()
            raise RenderWorkerDied("a chat template worker process did not start")

    @property
    def pid(self) -> int:
        return self.process.pid

    def call(self, request: Any, *, pickled: bool = False) -> Any:
        """Send ``request`` (bytes already pickled if ``pickled``), return the worker's answer or raise the
        exception it raised; raises RenderWorkerDied if the worker is gone."""
        try:
            self._stdin.write(request if pickled else pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
            self._stdin.flush()
            ok, value = pickle.load(self._stdout)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
            self.kill()
            raise RenderWorkerDied(f"a chat template worker process died ({type(exc).__name__})") from None
        if not ok:
            raise value
        return value

    def kill(self) -> None:
        for pipe in (self._stdin, self._stdout):
            try:
                pipe.close()
            except OSError:
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """Ask the worker to exit (its stdin closes), kill it if it has not within 5 s."""
        try:
            self._stdin.close()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class RenderPool:
    """``processes`` worker processes holding a copy of ``tokenizer`` (pickled once, here). Thread-safe."""

    def __init__(self, tokenizer: Any, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"a render pool needs at least one process, got {processes}")
        self.processes = processes
        self._tokenizer = tokenizer
        self._template = getattr(tokenizer, "chat_template", None)
        self._payload = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._started = False
        self._closed = False
        self._generation = 0  # bumped by start() reopening a closed pool

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, processes: int) -> RenderPool | None:
        """A pool for ``tokenizer`` with ``processes`` workers (-1: :func:`default_render_processes`), or None
        if ``processes`` is 0 or the tokenizer cannot be pickled (the preparation threads then render)."""
        if processes == 0:
            return None
        try:
            return cls(tokenizer, processes if processes > 0 else default_render_processes())
        except Exception as exc:  # pickling a backend's tokenizer may fail in many ways
            logger.info("chat templates render on the preparation threads: the tokenizer cannot be sent to a "
                        "worker process (%s: %s)", type(exc).__name__, exc)
            return None

    def start(self) -> None:
        """Spawn the workers on background threads; returns at once. Idempotent; reopens a closed pool."""
        with self._lock:
            if self._closed:
                self._closed, self._started = False, False
                self._generation += 1  # workers still starting or busy from before close() are not ours
                self._idle = queue.Queue()  # drop the wake-up marker close() left
        self._ensure_started()

    def close(self) -> None:
        """Stop the workers: idle ones now, busy ones when their call returns; calls raise RuntimeError until
        :meth:`start` reopens the pool. Idempotent."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker is not None:
                self._forget(worker)
                worker.stop()
        self._idle.put(None)  # wakes a caller waiting for a worker (each puts it back for the next)
        logger.debug("render pool closed (%d workers)", len(workers))

    def serves(self, tokenizer: Any) -> bool:
        """The workers hold a copy of ``tokenizer`` as it is now: the same object, its chat template unchanged
        since the pool was made (``--chat-template`` is set before the app is created)."""
        return tokenizer is self._tokenizer and getattr(tokenizer, "chat_template", None) == self._template

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], **options: Any) -> list[int]:
        """The tokenizer's ``apply_chat_template(messages, **options)``, run in a worker (blocks this thread)."""
        return list(self._call(("apply_chat_template", (list(messages),), dict(options))))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The tokenizer's ``encode``, run in a worker (blocks this thread)."""
        return list(self._call(("encode", (text,), {"add_special_tokens": add_special_tokens})))

    def worker_pids(self) -> list[int]:
        """Process ids of the workers started (tests and diagnostics)."""
        with self._lock:
            return [worker.pid for worker in self._workers]

    # -- internals ---------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
            generation = self._generation
        for index in range(self.processes):  # in parallel: each worker takes about a second to import and load
            threading.Thread(target=self._spawn_idle, args=(generation,), name=f"gemmaserve-render-start-{index}",
                             daemon=True).start()

    def _current(self, generation: int) -> bool:
        """The pool is open and ``generation`` is its current opening (call under the lock)."""
        return not self._closed and generation == self._generation

    def _spawn(self, generation: int) -> _Worker:
        worker = _Worker(self._payload, generation)
        with self._lock:
            current = self._current(generation)
            if current:
                self._workers.add(worker)
        if not current:
            worker.stop()
            raise RuntimeError("the render pool is closed")
        return worker

    def _spawn_idle(self, generation: int) -> None:
        try:
            self._release(self._spawn(generation))  # one that finished starting after close() is stopped there
        except Exception:
            with self._lock:
                current = self._current(generation)
            if current:
                logger.exception("could not start a chat template worker process")
                self._idle.put(None)  # a waiting caller wakes and tries a fresh worker

    def _forget(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)

    def _release(self, worker: _Worker) -> None:
        """Back to the idle queue, or stopped when the pool is closed (or was reopened since the worker was
        started). Checked and queued under the lock, so close() (which sets the flag under it, then drains the
        queue) never misses a worker."""
        with self._lock:
            stale = not self._current(worker.generation)
            if stale:
                self._workers.discard(worker)
            else:
                self._idle.put(worker)
        if stale:
            worker.stop()

    def _call(self, request: tuple[str, tuple[Any, ...], dict[str, Any]]) -> Any:
        self._ensure_started()
        worker = self._idle.get()
        if worker is None:
            with self._lock:
                closed, generation = self._closed, self._generation
            if closed:
                self._idle.put(None)  # the next waiter sees it too
                raise RuntimeError("the render pool is closed")
            worker = self._spawn(generation)  # a worker failed to start: try a fresh one
        for attempt in (1, 2):
            try:
                result = worker.call(request)
            except RenderWorkerDied:
                self._forget(worker)
                logger.warning("a chat template worker process died (attempt %d of 2); replacing it", attempt)
                worker = self._spawn(worker.generation)
                if attempt == 2:
                    self._release(worker)
                    raise RenderWorkerDied("the chat template worker process died twice while preparing this "
                                           "request") from None
                continue
            except BaseException:
                self._release(worker)
                raise
            self._release(worker)
            return result
        raise AssertionError("unreachable")


def _serve() -> None:
    """Worker process: read the pickled tokenizer, answer ``ready``, then answer requests until stdin closes.
    Exits quietly (status 0, nothing on stderr) when the server is gone: its stdin at EOF, or its answer pipe
    closed (the server exited while the worker was starting or answering)."""
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever prints lands on stderr, never in the answers
    sys.stdout = sys.stderr
    try:
        os.nice(RENDER_WORKER_NICE)
    except OSError:
        pass

    def answer(ok: bool, value: Any) -> None:
        try:
            data = pickle.dumps((ok, value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an exception that cannot be pickled
            data = pickle.dumps((False, RuntimeError(f"{type(value).__name__}: {value} ({exc})")))
        try:
            channel_out.write(data)
            channel_out.flush()
        except OSError:  # BrokenPipeError: nobody reads the answers any more
            os._exit(0)  # not sys.exit: flushing the buffered answer at interpreter exit would fail again

    try:
        tokenizer = pickle.load(channel_in)
    except EOFError:
        return
    answer(True, _READY)
    while True:
        try:
            method, args, kwargs = pickle.load(channel_in)
        except EOFError:
            return
        try:
            answer(True, getattr(tokenizer, method)(*args, **kwargs))
        except Exception as exc:
            answer(False, exc)


if __name__ == "__main__":
    _serve()
