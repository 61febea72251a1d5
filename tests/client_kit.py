"""A real Mooncake store client with its calls in flight counted, to check that a client is
never closed under a call (the scheduler's shutdown, the breaker's probe)."""

from __future__ import annotations

import threading
from typing import Any


class CallRecorder:
    """Wraps a client: every method call counts as in flight while it runs, and close()
    records how many were in flight, then waits for them before closing the real client (so
    a test cannot crash the process by freeing the client under a call, even on code that
    would)."""

    def __init__(self, client: Any) -> None:
        self._client, self.in_flight, self.in_flight_at_close = client, 0, None
        self._idle = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._idle:
                self.in_flight += 1
            try:
                return method(*args, **kwargs)
            finally:
                with self._idle:
                    self.in_flight -= 1
                    self._idle.notify_all()

        return call

    def close(self) -> None:
        with self._idle:
            self.in_flight_at_close = self.in_flight
            self._idle.notify_all()
            self._idle.wait_for(lambda: self.in_flight == 0)
        self._client.close()

    def wait_closed(self, timeout: float) -> int:
        """Block until close() ran; returns the calls that were in flight then."""
        with self._idle:
            assert self._idle.wait_for(lambda: self.in_flight_at_close is not None, timeout), \
                "the client was never closed"
            return self.in_flight_at_close
