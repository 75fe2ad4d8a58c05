"""Connection-level protection of the HTTP server against idle, slow and too many clients.

uvicorn's h11 protocol only times out a connection *between* requests (``timeout_keep_alive``, armed
after a response), and its ``limit_concurrency`` answers a plain-text 503 but still lets any number of
idle sockets sit open. :func:`guarded_protocol_class` builds an h11 protocol that also

- closes a fresh connection that sends nothing for ``timeout_keep_alive`` seconds (as uvicorn does
  between requests),
- gives a request ``header_timeout`` seconds from its first byte to finish its request line and headers,
  and ``body_timeout`` seconds from the end of its headers to finish its body; past either it answers
  408 (OpenAI error body) if no response has started, and closes the connection,
- lets the app drop a connection at once (:data:`ABORT_KEY`: a stream whose client stopped reading) and see
  what its client has not read yet (:data:`UNSENT_KEY`),
- admits at most ``limit_concurrency`` connections at a time: a request on a connection beyond that gets
  a 503 (``code: "too_many_connections"``, ``Retry-After``, ``Connection: close``) from the app's guard,
  which sees :data:`OVER_LIMIT_KEY` in the request scope's state.

:class:`AcceptErrorFilter` is an event-loop exception handler: when the process runs out of file
descriptors, asyncio's accept loop logs a full traceback for every pending connection (thousands per
second); the filter turns them into one warning line per interval with a count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ConnectionLimits",
    "guarded_protocol_class",
    "AcceptErrorFilter",
    "OVER_LIMIT_KEY",
    "ABORT_KEY",
    "UNSENT_KEY",
    "TIMED_OUT_KEY",
    "raise_fd_limit",
    "effective_connection_limit",
]

logger = logging.getLogger(__name__)

OVER_LIMIT_KEY = "gemmaserve.over_connection_limit"
"""Set (True) in the ``state`` of every request scope of a connection accepted beyond the limit."""
ABORT_KEY = "gemmaserve.abort_connection"
"""In the ``state`` of every request scope: a callable that drops the connection at once, unsent data included (a
stream whose client stopped reading: closing would wait for the data to be read first)."""
UNSENT_KEY = "gemmaserve.unsent_bytes"
"""In the ``state`` of every request scope: a callable giving the bytes written but not yet taken by the client's
socket (the transport's write buffer): a stream sees a slow reader's progress by it shrinking."""
TIMED_OUT_KEY = "gemmaserve.timed_out"
"""Set (True) in the scope of a request whose body did not arrive in time (answered 408 by the connection)."""
FD_HEADROOM = 64
"""File descriptors kept free of client connections (model files, logs, pipes, the listening socket)."""
_ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Seconds a fresh or idle connection may stay silent, a request may take to send its headers and its
    body; the most connections served at once (None = unbounded)."""

    timeout_keep_alive: float
    header_timeout: float
    body_timeout: float
    limit_concurrency: int | None


def _timeout_response(what: str, seconds: float) -> bytes:
    body = json.dumps({"error": {
        "message": f"the request {what} was not received within {seconds:g} s; the connection is closed",
        "type": "invalid_request_error", "param": None, "code": "request_timeout",
    }}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def guarded_protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """An h11 protocol class (uvicorn ``Config(http=...)``) enforcing ``limits``; one per server."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    admitted: set[asyncio.Protocol] = set()

    class GuardedH11Protocol(H11Protocol):  # type: ignore[misc]
        _deadline: asyncio.TimerHandle | None = None
        _deadline_kind: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            state = {**self.app_state, ABORT_KEY: transport.abort,  # this connection's own copy
                     UNSENT_KEY: transport.get_write_buffer_size}
            if limits.limit_concurrency is not None and len(admitted) >= limits.limit_concurrency:
                state[OVER_LIMIT_KEY] = True
            else:
                admitted.add(self)
            self.app_state = state
            # uvicorn arms its keep-alive timer only after a response: a connection that never sends a byte
            # would otherwise hold its file descriptor forever
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def connection_lost(self, exc: Exception | None) -> None:
            admitted.discard(self)
            self._set_deadline(None)
            super().connection_lost(exc)

        def _should_upgrade(self) -> bool:
            """Never: the server has no WebSocket route, and an upgrade would hand the transport to another
            protocol, so this one would never see ``connection_lost`` and its place among the admitted
            connections would leak (LIMIT_CONCURRENCY upgrade requests locked every client out with 503s).
            An ``Upgrade`` header is ignored: the request is served as plain HTTP, with no warning to log."""
            return False

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track_phase()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track_phase()

        def _track_phase(self) -> None:
            """Arm the header deadline once a request's first bytes are buffered, the body deadline once its
            headers are parsed; disarm both once the request is fully received."""
            if self.transport.is_closing():
                self._set_deadline(None)
                return
            state = self.conn.their_state
            if state is h11.IDLE:
                kind = "headers" if self.conn.trailing_data[0] else None
            elif state is h11.SEND_BODY:
                kind = "body"
            else:
                kind = None
            self._set_deadline(kind)

        def _set_deadline(self, kind: str | None) -> None:
            if kind == self._deadline_kind:
                return
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._deadline_kind = kind
            if kind is not None:
                seconds = limits.header_timeout if kind == "headers" else limits.body_timeout
                self._deadline = self.loop.call_later(seconds, self._on_deadline, kind, seconds)

        def _on_deadline(self, kind: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            logger.debug("closing a connection from %s: request %s not received within %g s", self.client, kind,
                         seconds)
            # headers: no cycle exists for the request being received (``self.cycle`` is a previous, finished one on
            # a keep-alive connection), so the 408 goes out whatever that one did; body: the cycle is this request's
            cycle = self.cycle if kind == "body" else None
            if cycle is None or not cycle.response_started:
                self.transport.write(_timeout_response(kind, seconds))
                if cycle is not None:
                    cycle.scope[TIMED_OUT_KEY] = True  # the app counts 408, not a client that went away
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app reading the body sees http.disconnect
                cycle.message_event.set()
            self.transport.close()

    return GuardedH11Protocol


class AcceptErrorFilter:
    """Event-loop exception handler: failed ``accept()`` calls for lack of file descriptors (EMFILE, ENFILE,
    ENOBUFS, ENOMEM) become one warning line per ``interval`` seconds, with how many failed; every other
    context goes to the loop's default handler."""

    def __init__(self, interval: float = 10.0, clock: Any = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last: float | None = None
        self._count = 0
        self.total = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_OUT_OF_RESOURCES:
            loop.default_exception_handler(context)
            return
        self.total += 1
        self._count += 1
        now = self._clock()
        if self._last is None or now - self._last >= self.interval:
            since = "" if self._last is None else f" in the last {now - self._last:.0f} s"
            logger.warning(
                "cannot accept new connections: %s (%d failed accept() calls%s; repeats are summarized every "
                "%g s); raise the file-descriptor limit (ulimit -n) or lower --limit-concurrency",
                context.get("exception"), self._count, since, self.interval,
            )
            self._last = now
            self._count = 0


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as vLLM does); returns the soft limit now in effect."""
    import resource  # POSIX only: imported here so the app module imports anywhere

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            logger.debug("could not raise RLIMIT_NOFILE from %d", soft)
    return soft


def effective_connection_limit(requested: int, fd_limit: int) -> int:
    """``requested``, lowered so that admitted connections leave :data:`FD_HEADROOM` descriptors free."""
    ceiling = max(1, fd_limit - FD_HEADROOM)
    if requested > ceiling:
        logger.warning("LIMIT_CONCURRENCY=%d exceeds what %d file descriptors allow; serving at most %d connections",
                       requested, fd_limit, ceiling)
        return ceiling
    return requested
