"""The server's connections: a deadline for each request's headers, which uvicorn lacks (a client that sends them
a byte at a time, or never ends them, would hold its connection for ever).

The cap on open connections is uvicorn's own `limit_concurrency`; this deadline is what frees the connections
that never send a request, under the cap or over it.
"""

from __future__ import annotations

import asyncio

DEFAULT_HEADER_TIMEOUT_S = 10.0  # serve --header-timeout
DEFAULT_MAX_CONNECTIONS = 512  # serve --max-connections (well under the usual 1024 open files a process may have)


def with_header_deadline(protocol: type[asyncio.Protocol], seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `protocol` (h11's or httptools'), where a connection that has not sent a whole
    request's headers within `seconds` of opening, or of its last response, is closed."""

    class HeaderDeadline(protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers have their own deadline

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _expire(self) -> None:
            """Closes the connection unless a request is under way (its headers came since the deadline was set:
            any request since then that has already finished would have set a new one)."""
            self.deadline = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return HeaderDeadline
