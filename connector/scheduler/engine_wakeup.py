"""Waking an idle engine so that the connector's queued events reach vLLM's publisher.

vLLM takes a connector's KV events only inside an engine step (`Scheduler.update_from_output`
calls `take_events`), and an idle `EngineCoreProc` takes no step: its busy loop blocks on its
input queue until a request arrives. `has_pending_push_work()` (vLLM 0.32 and 0.33) makes the
loop step while it is true, but only once the loop looks again. So a store removal the sweep
finds while the engine is idle would wait for the next request.

`EngineWakeup.wake()` puts vLLM's own WAKEUP sentinel (`EngineCoreRequestType.WAKEUP`, which
the loop handles as a no-op) into that input queue: the loop then checks for work, sees the
pending events, and takes one step with nothing scheduled, which publishes them. The queue is
found once, at construction, on the call stack: vLLM builds the scheduler-side connector inside
`Scheduler.__init__`, inside `EngineCoreProc.__init__`, which made `self.input_queue` first
(vllm/v1/engine/core.py). Where it is not found (an engine stepped by its caller, such as an
offline `LLM`, which steps whenever it is asked; another vLLM; unit tests), `wake` does nothing
and the events wait for the next step, as the docs say.
"""

from __future__ import annotations

import inspect
import logging
import queue
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level


class EngineWakeup:
    def __init__(self, input_queue: queue.Queue | None) -> None:
        self._queue = input_queue
        self._sentinel: Any = None
        if input_queue is not None:
            from vllm.v1.engine import EngineCoreRequestType

            self._sentinel = (EngineCoreRequestType.WAKEUP, None)

    @classmethod
    def find(cls, max_frames: int = 30) -> EngineWakeup:
        """The input queue of the EngineCoreProc that is constructing this connector, if any."""
        frame = inspect.currentframe()
        try:
            for _ in range(max_frames):
                if frame is None:
                    break
                owner = frame.f_locals.get("self")
                q = getattr(owner, "input_queue", None) if owner is not None else None
                if isinstance(q, queue.Queue) and type(owner).__name__.endswith("EngineCoreProc"):
                    return cls(q)
                frame = frame.f_back
        finally:
            del frame
        logger.info("store KV events: no engine loop to wake (not inside vLLM's "
                    "EngineCoreProc); events found while the engine is idle wait for its next "
                    "step")
        return cls(None)

    @property
    def found(self) -> bool:
        return self._queue is not None

    def wake(self) -> None:
        """Make an idle engine look for work now (a busy one ignores it)."""
        if self._queue is not None:
            self._queue.put_nowait(self._sentinel)
