"""Compiling :class:`~gemmaserve.structured.spec.StructuredOutputs` with llguidance, and the per-request
:class:`TokenConstraint` the scheduler consults every step.

Why llguidance: a Rust matcher with a Python wheel that needs neither torch nor a compiler (``import gemmaserve``
stays light; every backend gets the same masks), JSON schema, regex, Lark and GBNF in one engine, and masks for
Gemma's 262,144-token vocabulary in ~0.1 ms (p50) to ~3 ms (worst step) on one CPU core (docs/api.md,
"Structured output"). xgrammar needs torch at import.

The vocabulary comes from the tokenizer's Hugging Face ``tokenizer.json`` (``Tokenizer.tokenizer_json()``, an
optional part of the tokenizer protocol). Building llguidance's tokenizer takes ~4 s for Gemma's vocabulary,
once per engine, on the first constrained request's thread (or at start-up through :meth:`GrammarCompiler.warm`).
Compiled grammars are cached by the constraint's canonical text; each request gets a copy of the cached matcher.
Thread-safe: compile on any thread; a :class:`TokenConstraint` belongs to one request (the engine thread).
:func:`allowed_many` computes the masks of a whole batch at once on llguidance's thread pool: 64 rows of JSON on
Gemma's vocabulary take ~1.0–1.1 ms on two cores instead of ~2.4–3.2 ms one by one (``benchmarks/sampling.py
--tokenizer``). llguidance 1.9 releases the GIL while its pool works: with the masks of 64 rows computed in a loop
on a second thread, a Python loop on the first kept 76-89 % of its rate (2-core CPU machine, ad hoc). The masks of
a step still sit on the engine thread's critical path, because the sampling they feed is launched after them; a
thread computing them must also get the GIL back promptly (Python's 5 ms switch interval made each call ~6 ms
there instead of ~1 ms; 0.2 ms brought it back to ~1.1 ms), and a shorter interval for the whole engine slowed it
under load (docs/benchmarks.md, run 27).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import json
import os
import queue
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from gemmaserve.errors import InvalidRequestError

from .spec import StructuredOutputs

__all__ = ["ConstraintError", "GrammarCompiler", "MASK_THREAD_NAME", "MaskBatch", "MaskMemory", "TokenConstraint",
           "allowed_many", "mask_rows", "mask_rows_span", "start_masks"]

MaskMemory = Callable[[int], "tuple[int, object] | None"]
"""Where a batch's masks are written (``InferenceBackend.mask_memory``): ``nbytes`` -> ``(address, owner)``, at
least that many writable bytes at ``address`` (4-byte aligned: llguidance writes 32-bit words) that stay valid
while ``owner`` lives (None: a fresh ``bytearray``)."""

_CACHE_SIZE = 256
_executor: Any = None  # llguidance's executor; benchmarks swap it for one of another pool size
_executor_lock = threading.Lock()


class ConstraintError(RuntimeError):
    """A running constraint cannot continue (no token allowed, or the sampled token was rejected): the request
    ends with this error (``finish_reason="error"``); the others keep running."""


class TokenConstraint:
    """One request's position in its grammar. :meth:`allowed` is the mask of the next token; :meth:`accept`
    advances by the token that was picked. Not thread-safe (the engine thread owns it)."""

    def __init__(self, matcher: Any, what: str, mask_bytes: int) -> None:
        self._matcher = matcher
        self._what = what
        self.mask_bytes = mask_bytes
        """Length of one mask: the vocabulary in 32-bit words (llguidance's layout, little-endian)."""

    _widens = False
    """True for a constraint whose :meth:`_widen` adds tokens to the matcher's mask."""

    def allowed(self) -> bytes:
        """Bitmask of the tokens that may come next (``RowSampling.allowed``'s layout). Raises ConstraintError
        when the grammar is in an error state or allows no token at all."""
        matcher = self._mask_matcher()
        if matcher is None:
            return self._unconstrained()
        mask = matcher.compute_bitmask()[:self.mask_bytes]
        if self._widens:
            mask = bytearray(mask)
            self._widen(mask)
            mask = bytes(mask)
        if self._cannot_continue(mask):
            raise self._stuck()
        return mask

    def _mask_matcher(self) -> Any:
        """The llguidance matcher whose mask is the next token's, or None when every token may come next (a
        :class:`~gemmaserve.structured.triggered.TriggeredConstraint` waiting for its trigger)."""
        return self._matcher

    def _unconstrained(self) -> bytes:
        """The mask that allows every token of the vocabulary (for :meth:`_mask_matcher` None)."""
        raise NotImplementedError("a constraint without a matcher must say what it allows")

    def _widen(self, mask: Any) -> None:
        """Add tokens to the matcher's ``mask`` (a writable buffer, changed in place); only with :attr:`_widens`."""

    def _cannot_continue(self, mask: bytes | memoryview) -> bool:
        """True when the grammar is in an error state or ``mask`` (``mask_bytes`` long) allows nothing (compared
        with memcmp, which stops at the first allowed token: at most ~1.3 µs for Gemma's vocabulary)."""
        matcher = self._mask_matcher()
        if matcher is None:
            return False
        return bool(matcher.is_error()) or _zeros(self.mask_bytes).startswith(mask)

    def _stuck(self) -> ConstraintError:
        """Why no token can come next: the grammar's error, or (none recorded) a mask that allows nothing."""
        matcher = self._mask_matcher()
        detail = f" ({_first_line(matcher.get_error())})" if matcher.is_error() else ""
        return ConstraintError(f"no token can continue the {self._what} constraint from here{detail}")

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; True when the constraint is now complete (the request stops). Raises
        ConstraintError if the grammar rejects the token (a backend that did not apply the mask), staying where it
        was. Subclasses change :meth:`advance_if_valid` only."""
        result = self.advance_if_valid(token_id)
        if isinstance(result, ConstraintError):
            raise result
        return result

    def advance_if_valid(self, token_id: int) -> bool | ConstraintError:
        """Advance by ``token_id`` when the grammar accepts it, returning :meth:`accept`'s result; when it does not,
        stay where it was and return the ConstraintError that :meth:`accept` would raise (undo a successful
        advance with :meth:`rollback`). One native call when the token is accepted (the common case: it was
        sampled under this constraint's mask)."""
        return _grammar_step(self._matcher, self._what, token_id)

    def rollback(self) -> None:
        """Undo the last advance (a token taken ahead and then not appended)."""
        if not self._matcher.rollback(1):
            raise RuntimeError(f"could not roll the {self._what} constraint back one token "
                               f"({_first_line(self._matcher.get_error())})")

    def copy(self) -> TokenConstraint:
        """An independent constraint at the same position (advancing one leaves the other as it was)."""
        return TokenConstraint(self._matcher.deep_copy(), self._what, self.mask_bytes)

    @property
    def is_complete(self) -> bool:
        return bool(self._matcher.is_stopped())


def _grammar_step(matcher: Any, what: str, token_id: int) -> bool | ConstraintError:
    """Advance llguidance's ``matcher`` by ``token_id``: whether it is now complete, or (``matcher`` as it was)
    the ConstraintError naming why the grammar refuses the token (``what``: the constraint's kind)."""
    if matcher.try_consume_tokens([token_id]) == 1:
        return bool(matcher.is_stopped())
    probe = matcher.deep_copy()
    if probe.consume_token(token_id):  # taken one token at a time although refused in a batch of one: take it
        matcher.consume_token(token_id)
        return bool(matcher.is_stopped())
    return ConstraintError(f"token {token_id} does not continue the {what} constraint "
                           f"({_first_line(probe.get_error()) or 'rejected'}); the request's bad_words or logit_bias "
                           "may exclude every token the constraint allows at this point")


@functools.lru_cache(maxsize=8)
def _zeros(width: int) -> bytes:
    """An all-zero mask of ``width`` bytes (compared with memcmp: ~1 µs for Gemma's vocabulary; a strip takes
    ~100 µs)."""
    return bytes(width)


def allowed_many(constraints: Sequence[TokenConstraint]) -> list[memoryview | ConstraintError]:
    """:meth:`TokenConstraint.allowed` of every constraint (all compiled against one vocabulary), computed in
    parallel on llguidance's thread pool: ``start_masks(constraints, overlap=False).result()``. Engine thread
    only."""
    return start_masks(constraints, overlap=False).result()


def start_masks(constraints: Sequence[TokenConstraint], *, overlap: bool = True,
                memory: MaskMemory | None = None) -> MaskBatch:
    """Start computing the masks of ``constraints`` (all compiled against one vocabulary) on the mask thread,
    which hands them to llguidance's pool, and return at once: the calling thread runs Python meanwhile (the
    native work holds no GIL). Until :meth:`MaskBatch.result` returns, the constraints must not be advanced or
    copied (the pool reads them) and the masks' bytes are being written. ``overlap=False``: the native call is
    made on the calling thread before returning (for a caller with nothing to do meanwhile: the two thread
    hand-overs cost ~0.2 ms on a 2-core machine). ``memory``: where the masks are written (the backend's
    ``mask_memory``, e.g. pinned host memory it copies to the device without staging); llguidance writes every
    byte, so it need not be zeroed. Engine thread only."""
    if not constraints:
        return MaskBatch(_mask_block(0, None), 0, [])
    width = constraints[0].mask_bytes
    if any(c.mask_bytes != width for c in constraints):
        raise ValueError("start_masks needs constraints compiled against one vocabulary")
    batch = MaskBatch(_mask_block(width * len(constraints), memory), width, constraints)
    if overlap:
        _mask_thread().submit(batch)
    else:
        batch._compute()
    return batch


def _mask_block(size: int, memory: MaskMemory | None) -> Any:
    """A batch's buffer: a ctypes char array over ``size`` bytes of ``memory`` (or of a fresh ``bytearray``) that
    carries ``owner``, what keeps that memory alive. Views hold the array, the array holds the owner (and, once
    :class:`MaskBatch` set them, its rows' layout for :func:`mask_rows_span`: weak references, no cycle): the
    memory is freed when the last view goes."""
    placed = memory(size) if memory is not None and size else None
    if placed is None:
        owner: object = bytearray(size)
        block = (ctypes.c_char * size).from_buffer(owner)
    else:
        address, owner = placed
        _check_placement(address, owner, size)
        block = (ctypes.c_char * size).from_address(address)
    block.owner = owner
    return block


def _check_placement(address: int, owner: object, size: int) -> None:
    """Raise ValueError unless ``address`` is 4-byte aligned and, where ``owner`` tells its extent (a tensor-like
    ``data_ptr()`` / ``nbytes``, a ctypes object), ``size`` bytes from ``address`` lie inside it: a
    ``mask_memory`` that hands out too little would have llguidance write past its end."""
    if not isinstance(address, int) or address <= 0 or address % 4:
        raise ValueError(f"mask_memory gave address {address!r}: a positive, 4-byte aligned address is needed")
    if callable(getattr(owner, "data_ptr", None)) and isinstance(getattr(owner, "nbytes", None), int):
        start, extent = owner.data_ptr(), owner.nbytes  # type: ignore[attr-defined]
    elif isinstance(owner, ctypes._SimpleCData | ctypes.Array | ctypes.Structure):
        start, extent = ctypes.addressof(owner), ctypes.sizeof(owner)
    else:
        return  # an owner that does not tell its extent: the contract's word
    if not start <= address <= address + size <= start + extent:
        raise ValueError(f"mask_memory gave {size} bytes at {address:#x}, outside its owner's {extent} bytes at "
                         f"{start:#x}")


def _row_views(block: Any, width: int, count: int) -> list[memoryview]:
    """The ``count`` rows of ``block`` (``_mask_block``) as writable views, their layout recorded on ``block`` for
    :func:`mask_rows_span`."""
    rows = memoryview(block).cast("B")
    views = [rows[i * width:(i + 1) * width] for i in range(count)]
    block.mask_width = width
    block.mask_rows = [weakref.ref(view) for view in views]
    block.mask_index = {id(view): i for i, view in enumerate(views)}
    return views


def mask_rows(count: int, width: int, memory: MaskMemory | None = None) -> list[memoryview]:
    """``count`` writable rows of ``width`` bytes (not zeroed when ``memory`` gives them), laid out as a batched
    mask call lays them out (:func:`start_masks`): what tests and the conformance kit hand to a backend's
    sampling as the engine would."""
    return _row_views(_mask_block(count * width, memory), width, count)


def mask_rows_span(masks: Sequence[object], width: int) -> tuple[Any, int] | None:
    """(block, byte offset) when ``masks`` are consecutive ``width``-byte rows of one :func:`start_masks` batch,
    in order: ``masks[i]`` starts at offset + i * width of ``block``, a ctypes char array over the batch's memory
    (a writable buffer; ``block.owner`` keeps the memory alive: a ``bytearray``, or the owner the backend's
    ``MaskMemory`` returned), else None. Reads no addresses (~0.1 µs a row)."""
    first = masks[0] if masks else None
    if not isinstance(first, memoryview):
        return None
    block = first.obj
    rows = getattr(block, "mask_rows", None)
    if rows is None or block.mask_width != width:
        return None
    start = block.mask_index.get(id(first), -1)
    if start < 0 or start + len(masks) > len(rows):
        return None
    for i, mask in enumerate(masks):
        if rows[start + i]() is not mask:
            return None
    return block, start * width


class MaskBatch:
    """The masks of a batch of constraints (:func:`start_masks`): one fresh buffer (a row's mask outlives the
    call) that llguidance writes once; ``views[i]`` is constraint ``i``'s slice of it, final once :meth:`result`
    returned. Who frees: nobody; the buffer (and its memory's owner) lives while a view of it does."""

    def __init__(self, block: Any, width: int, constraints: Sequence[TokenConstraint]) -> None:
        self._block = block
        self._width = width
        self._constraints = list(constraints)
        self.views = _row_views(block, width, len(self._constraints))
        self._started = threading.Event()
        self._done = threading.Event()
        self._claim = threading.Lock()  # the mask thread starts the batch, or the submitter gives it up: not both
        self._abandoned = False
        self._error: BaseException | None = None
        address = ctypes.addressof(block)
        self._native: list[tuple[Any, int]] = []
        """(matcher, row) of the rows llguidance computes; built here, on the submitter's thread, so the mask
        thread runs no Python per row (it would wait for the GIL the engine thread holds)."""
        for i, constraint in enumerate(self._constraints):
            matcher = constraint._mask_matcher()
            if matcher is None:  # every token allowed (a trigger not seen yet): written now, no native work
                ctypes.memmove(address + i * width, constraint._unconstrained(), width)
            else:
                self._native.append((matcher, i))

    def _compute(self) -> None:
        """On the mask thread: the native call (no GIL held while llguidance's pool works), unless the submitter
        gave the batch up (then its constraints are the submitter's again)."""
        with self._claim:
            if self._abandoned:
                return
            self._started.set()
        try:
            if self._native:
                _llguidance_executor().unsafe_compute_mask_ptr(self._native, ctypes.addressof(self._block),
                                                               self._width, len(self._constraints))
        except BaseException as exc:  # handed to result()
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> list[memoryview | ConstraintError]:
        """Wait for the masks: each constraint's view of its mask, or the ConstraintError of one that cannot
        continue (an error state or nothing allowed). Re-raises what the native call raised."""
        if self._constraints:
            self._done.wait()
        if self._error is not None:
            raise self._error
        for constraint, view in zip(self._constraints, self.views):
            if constraint._widens:
                constraint._widen(view)
        return [constraint._stuck() if constraint._cannot_continue(view) else view
                for constraint, view in zip(self._constraints, self.views)]


class _MaskThread:
    """One daemon thread that makes the native mask calls of :func:`start_masks`. ``submit`` waits until the
    thread has picked the batch up: the thread needs the GIL to start the call, and a thread that asks for it
    while the caller runs Python waits up to Python's switch interval (5 ms), so the caller hands it over by
    blocking for those few microseconds."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[MaskBatch] = queue.SimpleQueue()
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name=MASK_THREAD_NAME, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self._jobs.get()._compute()

    def submit(self, batch: MaskBatch) -> None:
        """Hand ``batch`` over and wait until the thread has started it. Raises RuntimeError (the batch given up,
        never to be computed) if the thread does not take it within :data:`_PICKUP_TIMEOUT_S`."""
        self._jobs.put(batch)
        if batch._started.wait(_PICKUP_TIMEOUT_S):
            return
        with batch._claim:
            if not batch._started.is_set():
                batch._abandoned = True
                raise RuntimeError(f"the structured-output mask thread did not start within {_PICKUP_TIMEOUT_S} s")


MASK_THREAD_NAME = "gemmaserve-masks"
"""The name of the thread that makes :func:`start_masks`' native calls (what a profiler or log shows)."""

_PICKUP_TIMEOUT_S = 5.0
"""How long :meth:`_MaskThread.submit` waits for the mask thread (microseconds when it is alive)."""


_thread: _MaskThread | None = None


def _mask_thread() -> _MaskThread:
    """The process's mask thread, started on first use (again in a forked child, which has no threads)."""
    global _thread
    with _executor_lock:
        if _thread is None or _thread.pid != os.getpid() or not _thread.thread.is_alive():
            _thread = _MaskThread()
        return _thread


def _llguidance_executor() -> Any:
    """llguidance's executor (its thread pool), created on first use."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


class GrammarCompiler:
    """Compiles constraints against one tokenizer. ``tokenizer`` needs ``tokenizer_json() -> str`` (the Hugging
    Face tokenizer.json text); ``vocab_size`` is the model's (masks cover it); ``eos_token_ids`` are the tokens
    a complete constraint allows last."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = [int(t) for t in eos_token_ids]
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._specials: re.Pattern[str] | None = None  # the special tokens' texts (see _forces_special_text)
        self._mask_bytes = 0
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._triggers: dict[str, int] = {}  # trigger text -> its token id (a handful of texts per server)
        self._special: tuple[int, int] | None = None  # see _special_masks
        self._refused: OrderedDict[str, str] = OrderedDict()  # constraint key -> the InvalidRequestError text

    @staticmethod
    def available(tokenizer: Any) -> str | None:
        """None when constraints can be compiled for ``tokenizer``, else why not (for an error message)."""
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return "the llguidance package is not installed (pip install llguidance)"
        if not callable(getattr(tokenizer, "tokenizer_json", None)):
            return "this backend's tokenizer does not expose its vocabulary (Tokenizer.tokenizer_json)"
        return None

    def warm(self) -> None:
        """Build the vocabulary now (seconds for a large one) instead of on the first constrained request."""
        self._vocabulary()

    def _vocabulary(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                problem = self.available(self._tokenizer)
                if problem is not None:
                    raise InvalidRequestError(f"structured_outputs cannot be served: {problem}")
                self._ll_tokenizer = _ll_tokenizer(self._tokenizer.tokenizer_json(), self._vocab_size,
                                                   tuple(self._eos))
                self._specials = _special_texts(self._ll_tokenizer)
                self._mask_bytes = (self._ll_tokenizer.vocab_size + 31) // 32 * 4
            return self._ll_tokenizer

    def _vocabulary_for(self, spec: StructuredOutputs) -> Any:
        """The vocabulary ``spec`` compiles against: the native one, or (for a constraint whose text spells a
        special token) the one whose tokenizer writes such text with ordinary tokens (:func:`_ll_text_tokenizer`;
        its tokenizer runs in Python, so it is kept to the constraints that need it)."""
        vocabulary = self._vocabulary()
        if self._specials is None or not _forces_special_text(spec, self._specials):
            return vocabulary
        return _ll_text_tokenizer(self._tokenizer.tokenizer_json(), self._vocab_size, tuple(self._eos))

    def compile(self, spec: StructuredOutputs) -> TokenConstraint:
        """A fresh constraint for ``spec`` (compiled once per distinct constraint, then copied). Raises
        InvalidRequestError naming what is wrong with the schema, regex, choice or grammar, or the limit of the
        constraint engine it exceeds (refusals are remembered too, so a repeated one costs no second compile).
        The first mask is computed here (see :func:`_first_step`), on the caller's thread: a request's first
        step on the engine thread then finds the lexer built. A ``trigger`` gives a
        :class:`~gemmaserve.structured.triggered.TriggeredConstraint`; InvalidRequestError unless the trigger is one
        token of the vocabulary that the constraint accepts first."""
        template = self.prepare(spec)
        if spec.opening is not None:
            from .opening import OpeningConstraint

            opening = self.prepare(StructuredOutputs(regex=f"(?:{spec.opening})(?s:.*)"))
            invisible, shown = self._special_masks()
            return OpeningConstraint(template.deep_copy(), opening.deep_copy(), invisible, shown, spec.kind,
                                     self._mask_bytes, self._vocab_size)
        if spec.trigger is None:
            return TokenConstraint(template.deep_copy(), spec.kind, self._mask_bytes)
        from .triggered import TriggeredConstraint

        trigger_id = self._trigger_id(spec.trigger)
        if template.deep_copy().try_consume_tokens([trigger_id]) != 1:
            raise InvalidRequestError(f"structured_outputs.trigger {spec.trigger!r} is not the first token the "
                                      f"{spec.kind} constraint allows; the constraint must begin with its trigger")
        return TriggeredConstraint(template, trigger_id, spec.kind, self._mask_bytes, self._vocab_size)

    def _special_masks(self) -> tuple[int, int]:
        """Bit masks (bit i: token i) of the vocabulary's tokens that llguidance writes no text with (special to
        it): those decoded text does not show (tokenizer.json's added tokens marked ``special``, which
        ``skip_special_tokens`` drops), and those it shows whose text starts with neither a blank nor ``{``, ``[`` or
        a backtick (Gemma's ``<b>``, ``<table>``...: text that rules a JSON opening out). Built once."""
        with self._lock:
            if self._special is None:
                vocabulary = self._ll_tokenizer
                hidden = {i for i in _hidden_special_ids(self._tokenizer.tokenizer_json()) if 0 <= i < self._vocab_size}
                invisible = shown = 0
                for token in hidden:
                    invisible |= 1 << token
                for token in _special_ids(vocabulary):
                    if token not in hidden and token < self._vocab_size:
                        text = vocabulary.decode_bytes([token]).decode("utf-8", errors="replace")
                        if text and text[0] not in " \t\r\n{[`":
                            shown |= 1 << token
                self._special = (invisible, shown)
            return self._special

    def _trigger_id(self, text: str) -> int:
        """The id of the one token ``text`` is (tokenized once per text); InvalidRequestError when the vocabulary
        writes it otherwise."""
        known = self._triggers.get(text)
        if known is not None:
            return known
        try:
            ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        except Exception as exc:
            raise InvalidRequestError(f"structured_outputs.trigger {text!r} cannot be tokenized: {exc}") from None
        if len(ids) != 1:
            raise InvalidRequestError(f"structured_outputs.trigger {text!r} is {len(ids)} tokens of this vocabulary; "
                                      "a trigger is the text of exactly one token (such as a special token)")
        with self._lock:
            if len(self._triggers) < _CACHE_SIZE:
                self._triggers[text] = int(ids[0])
        return int(ids[0])

    def prepare(self, spec: StructuredOutputs) -> Any:
        """``spec``'s compiled template (llguidance's matcher at the start; compiled and cached now if it is not
        yet): what :meth:`compile` copies. Raises InvalidRequestError as :meth:`compile` does."""
        key = spec.key
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
            refusal = self._refused.get(key)
            if refusal is not None:
                self._refused.move_to_end(key)
                raise InvalidRequestError(refusal)
        vocabulary = self._vocabulary_for(spec)
        try:
            template = _compile_threads().run(_template, vocabulary, spec)
        except InvalidRequestError as exc:
            with self._lock:
                self._refused[key] = str(exc)
                while len(self._refused) > _CACHE_SIZE:
                    self._refused.popitem(last=False)
            raise
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template


class _CompileThreads:
    """The threads that compile constraints (:func:`_template`), with :data:`COMPILE_STACK_BYTES` of stack each:
    llguidance's native grammar compiler recurses once per link of a chain of rule references (a Lark rule that
    names the next one, a JSON schema's ``$ref`` chain through ``$defs``), and a chain a constraint's 256 KiB can
    hold overflowed the 8 MiB stack of an ordinary thread: a segmentation fault that killed the whole server, not
    an exception (3,000 links crashed; 2,000 Lark rules or 1,000 ``$ref`` links were the most that compiled).
    ``run`` hands a call to them and waits for its result (or exception)."""

    def __init__(self, count: int) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]] = \
            queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        with _executor_lock:  # threading.stack_size is process-wide: set it only around these threads' start
            for size in (COMPILE_STACK_BYTES, COMPILE_STACK_BYTES // 4):  # the smaller one where memory is tight
                previous = threading.stack_size(size)
                try:
                    for index in range(len(self.threads), count):
                        thread = threading.Thread(target=self._serve, name=f"gemmaserve-grammar-{index}", daemon=True)
                        thread.start()
                        self.threads.append(thread)
                except RuntimeError:  # "can't start new thread": no room for such a stack (strict overcommit)
                    continue
                finally:
                    threading.stack_size(previous)
                break
        if not self.threads:
            raise RuntimeError(f"could not start a structured-output compile thread with a "
                               f"{COMPILE_STACK_BYTES // 4 >> 20} MiB stack (the memory for it is not available)")

    def _serve(self) -> None:
        while True:
            future, call, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call(*args))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

    def run(self, call: Callable[..., Any], *args: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, call, args))
        return future.result()


COMPILE_STACK_BYTES = 256 * 2**20
"""Each compile thread's stack (a quarter of it where a thread with this much cannot start). The most a 256 KiB
constraint can chain (~10,500 Lark rules, ~4,000 ``$ref`` links) compiled with 64 MiB; only the pages a compile
touches are committed."""

_compile_pool: _CompileThreads | None = None


def _compile_threads() -> _CompileThreads:
    """The process's compile threads (min(4, CPUs)), started on first use (again in a forked child)."""
    global _compile_pool
    pool = _compile_pool
    if pool is None or pool.pid != os.getpid():
        with _compile_pool_lock:
            if _compile_pool is None or _compile_pool.pid != os.getpid():
                _compile_pool = _CompileThreads(max(1, min(4, os.cpu_count() or 1)))
            pool = _compile_pool
    return pool


_compile_pool_lock = threading.Lock()


def _template(vocabulary: Any, spec: StructuredOutputs) -> Any:
    """llguidance's matcher of ``spec`` at its start, its first step taken (:func:`_first_step`), under
    :func:`_limits`. Run on :func:`_compile_threads`. Raises InvalidRequestError."""
    import llguidance

    try:
        text = _grammar_text(spec)
    except RecursionError:  # llguidance's GBNF-to-Lark conversion is Python
        raise InvalidRequestError(f"structured_outputs.{spec.kind} is nested too deeply to compile") from None
    template = llguidance.LLMatcher(vocabulary, text, log_level=0, limits=_limits())
    if template.is_error():
        raise InvalidRequestError(f"structured_outputs.{spec.kind} is invalid: {template.get_error().strip()}")
    _first_step(template, spec.kind)
    return template


def _first_step(template: Any, kind: str) -> None:
    """Compute ``template``'s first mask and advance a copy of it by one allowed token: building the lexer (up to
    :data:`_INITIAL_LEXER_FUEL`) and the parser's first rows is where a pathological constraint spends its time
    or hits llguidance's limits (a regex of nested repeats, a rule of thousands of alternatives), so both happen
    at compile time instead of on the engine thread, and such a constraint is refused with llguidance's reason.
    A constraint that allows no first token, or whose first allowed token the parser refuses (a small vocabulary
    that cannot spell the bytes it forces), is not refused here: the request ends with a ConstraintError."""
    mask = template.compute_bitmask()
    first = len(mask) - len(bytes(mask).lstrip(b"\0"))  # the first byte with an allowed token
    if template.is_error() or first == len(mask):  # no token can start it (the lexer is built all the same)
        return
    byte = mask[first]
    probe = template.deep_copy()
    probe.consume_token(first * 8 + (byte & -byte).bit_length() - 1)
    # a rejected token is not a limit: a small vocabulary that cannot spell the bytes a grammar forces has its mask
    # allow a token the parser then refuses; such a request ends with a ConstraintError, as before
    if probe.is_error() and _REJECTED not in probe.get_error():
        raise InvalidRequestError(f"structured_outputs.{kind} exceeds what the constraint engine accepts after its "
                                  f"first token: {_first_line(probe.get_error())}")


_REJECTED = "doesn't satisfy the grammar"
"""How llguidance's error for a token the grammar refuses reads (llguidance 1.9)."""

_INITIAL_LEXER_FUEL = 200_000
"""The fuel for building a constraint's lexer, the one llguidance limit set below its default (1,000,000, which let
one 40-byte regex take ~1-2 s of CPU; ordinary JSON schemas, formats and long enums need far less, docs/api.md)."""


@functools.cache
def _limits() -> Any:
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=_INITIAL_LEXER_FUEL)


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(text: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """llguidance's tokenizer of a ``tokenizer.json`` text, shared by every compiler in the process (an
    LLTokenizer is immutable; building one for Gemma's vocabulary takes ~2 s, so an engine started after
    another on the same tokenizer, offline or in a benchmark, does not pay it again)."""
    import llguidance

    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


def _hidden_special_ids(tokenizer_json: str) -> list[int]:
    """The ids of tokenizer.json's added tokens marked ``special`` (its ``added_tokens`` list is read alone: the
    whole file is tens of megabytes for a large vocabulary)."""
    at = tokenizer_json.find('"added_tokens"')
    start = tokenizer_json.find("[", at) if at >= 0 else -1
    if start < 0:
        return []
    try:
        tokens, _ = json.JSONDecoder().raw_decode(tokenizer_json, start)
    except ValueError:
        return []
    return [int(t["id"]) for t in tokens if isinstance(t, dict) and t.get("special") is True
            and isinstance(t.get("id"), int)]


@functools.lru_cache(maxsize=4)
def _special_ids(vocabulary: Any) -> tuple[int, ...]:
    """``vocabulary``'s special token ids (LLTokenizers are immutable: read once)."""
    return tuple(i for i in range(vocabulary.vocab_size) if vocabulary.is_special_token(i))


def _special_texts(vocabulary: Any) -> re.Pattern[str] | None:
    """A pattern matching the text of any of ``vocabulary``'s special tokens (None without any), written as a trie
    (shared prefixes once): a flat alternation of Gemma's 6,322 texts took 2.2 s to search 200 KB of ``<a``."""
    texts = {vocabulary.decode_bytes([i]).decode("utf-8", "replace") for i in _special_ids(vocabulary)}
    texts.discard("")
    return re.compile(_trie_pattern(sorted(texts))) if texts else None


def _trie_pattern(texts: Sequence[str]) -> str:
    """A regex matching exactly ``texts`` (non-empty, distinct), its alternatives grouped by their first character
    so that a search tries one branch per position instead of every text."""
    by_first: dict[str, list[str]] = {}
    ends = False
    for text in texts:
        if text:
            by_first.setdefault(text[0], []).append(text[1:])
        else:
            ends = True
    branches = [re.escape(first) + (_trie_pattern(rests) if rests != [""] else "")
                for first, rests in by_first.items()]
    body = "|".join(branches)
    if ends:  # a text ends here: what follows is optional
        return f"(?:{body})?"
    return body if len(branches) == 1 else f"(?:{body})"


_ESCAPED = re.compile(r"\\([^A-Za-z0-9])")


def _strings(value: Any) -> list[str]:
    """Every string of a JSON value (keys included), at any depth (no recursion: a schema may nest deeper than
    Python's recursion limit)."""
    found: list[str] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            found.extend(key for key in item if isinstance(key, str))
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return found


def _grammar_literals(text: str, specials: re.Pattern[str]) -> list[str]:
    """The quoted literals and Lark regexes of a grammar: where it writes text. A special token's text outside them
    is a reference to the token (``<eos>``, Gemma 4's ``<|"|>``, whose quote opens no literal), a negated regex
    (``~/.../``) excludes text rather than forcing it, and a GBNF character class is skipped (``[^"]``)."""
    found, at, size = [], 0, len(text)
    gbnf = "::=" in text  # GBNF: [...] is a character class (it may hold a quote); in Lark an optional group
    negated = False  # the last character outside literals and blanks was "~"
    while at < size:
        char = text[at]
        if char == "<" and (match := specials.match(text, at)) is not None:
            at, negated = match.end(), False
            continue
        if char == "[" and gbnf:
            at += 1
            while at < size and text[at] != "]":
                at += 2 if text[at] == "\\" else 1
            at, negated = at + 1, False
            continue
        if char in "\"/" and (char == '"' or text[at + 1 : at + 2] not in ("", "/")):
            end = at + 1
            while end < size and text[end] != char and text[end] != "\n":
                end += 2 if text[end] == "\\" else 1
            if char == '"' or not negated:
                found.append(text[at + 1 : end])
            at, negated = end + 1, False
            continue
        if char == "#" or text.startswith("//", at):  # a comment runs to the end of its line
            at = text.find("\n", at)
            at = size if at < 0 else at
            continue
        if not char.isspace():
            negated = char == "~"
        at += 1
    return found


def _forces_special_text(spec: StructuredOutputs, specials: re.Pattern[str]) -> bool:
    """Whether ``spec`` may force text that spells a special token: a choice, regex or schema string holding such
    text, or a grammar holding it in a literal (:func:`_grammar_literals`), with punctuation escapes read as the
    characters. (A regex spelling one through classes or other escapes is not seen.)"""
    if spec.kind == "choice":
        texts: Sequence[str] = spec.choice or ()
    elif spec.kind == "grammar":
        texts = _grammar_literals(spec.grammar or "", specials)
    elif spec.kind == "regex":
        texts = [spec.regex or ""]
    elif spec.kind == "json":
        texts = _strings(spec.json)
    else:
        return False
    return any(specials.search(_ESCAPED.sub(r"\1", text)) for text in texts)


@functools.lru_cache(maxsize=4)
def _ll_text_tokenizer(text: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """llguidance's tokenizer of ``tokenizer.json`` whose text tokenizer never matches special tokens: forced text
    that spells one (``<eos>``, ``<pad>``, Gemma 4's ``<|"|>``) is written with ordinary tokens. The native one
    tokenized such forced bytes as the special token, which its own parser then refused, so a satisfiable choice,
    regex or enum holding such text ended its request with a ConstraintError. Special tokens stay special (a
    grammar can still name them, ``<eos>`` in Lark). Its masks equal the native one's elsewhere, but llguidance
    calls its tokenizer (Python, under the GIL) whenever it needs forced text tokenized, so only constraints
    that need it use it. ~2 s more to build for Gemma's vocabulary."""
    import llguidance
    import tokenizers

    eos = list(eos_token_ids) or None
    plain = _ll_tokenizer(text, vocab_size, eos_token_ids)
    encoder = tokenizers.Tokenizer.from_str(text)
    encoder.encode_special_tokens = True  # "<eos>" in a text is the characters, not the token
    encoder.no_padding()
    encoder.no_truncation()
    return llguidance.LLTokenizer(_TextTokenizer(plain, encoder), n_vocab=vocab_size, eos_token=eos)


class _TextTokenizer:
    """What llguidance's ``LLTokenizer`` reads from a tokenizer object (``llguidance.TokenizerWrapper``'s
    attributes): ``plain``'s token bytes and special tokens, and an encoder that never matches special tokens."""

    def __init__(self, plain: Any, encoder: Any) -> None:
        size = plain.vocab_size
        self.eos_token_id = plain.eos_token
        self.bos_token_id = None
        self.tokens = [plain.decode_bytes([i]) for i in range(size)]
        self.special_token_ids = list(_special_ids(plain))
        self.is_tokenizer_wrapper = True
        self._plain = plain
        self._encoder = encoder

    def __call__(self, data: bytes | str) -> list[int]:
        if isinstance(data, str):
            return self._encoder.encode(data, add_special_tokens=False).ids
        try:
            return self._encoder.encode(data.decode("utf-8"), add_special_tokens=False).ids
        except UnicodeDecodeError as exc:  # a cut character: the valid text, then the rest byte by byte
            head = self._encoder.encode(data[: exc.start].decode("utf-8"), add_special_tokens=False).ids
            return head + list(self._plain.tokenize_bytes(data[exc.start:]))


def _first_line(text: str) -> str:
    """llguidance's error text without the parser-state dump that follows its first line."""
    return text.strip().split("\n", 1)[0]


_MAX_GBNF_RULES = 500
"""Most rules a GBNF grammar may define: llguidance converts GBNF to Lark in Python in time quadratic in the rules
(0.23 s at 500, 3.5 s at 2,000, 8.9 s at 3,000 on one CPU core, holding the GIL between switches), while Lark
syntax goes straight to its native compiler."""

_GBNF_RULE = re.compile(r"(?:^|[\r\n])[ \t]*[A-Za-z0-9_-]+[ \t]*::=")
"""A GBNF rule's start: a name and ``::=`` at the start of a line, lines ended by ``\n``, ``\r\n`` or a lone ``\r``
(llguidance reads all three: counting ``\n`` lines only let a ``\r``-joined grammar past the rule limit)."""


def _check_gbnf_size(text: str) -> None:
    """Refuse a GBNF grammar of more than :data:`_MAX_GBNF_RULES` rules before converting it (a rule starts a line
    with ``name ::=``, :data:`_GBNF_RULE`; Lark rules, ``name: ...``, are not counted)."""
    rules = len(_GBNF_RULE.findall(text))
    if rules > _MAX_GBNF_RULES:
        raise InvalidRequestError(
            f"structured_outputs.grammar defines {rules} GBNF rules; at most {_MAX_GBNF_RULES} are accepted in GBNF "
            "(converting it takes time quadratic in the rules); write a larger grammar in Lark syntax "
            "(`start: ...`), which compiles natively")


def _grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of ``spec``; JSON without free whitespace between tokens. Raises
    InvalidRequestError for text llguidance cannot even read."""
    import llguidance

    compact = {"whitespace_flexible": False}
    kind = spec.kind
    if kind == "grammar":
        _check_gbnf_size(spec.grammar or "")
    try:
        if kind == "json":
            schema = spec.json if spec.json is not True else {}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=compact)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=compact)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice or ()))
        return llguidance.grammar_from("grammar", spec.grammar or "")
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"structured_outputs.{kind} is invalid: {exc}") from None
