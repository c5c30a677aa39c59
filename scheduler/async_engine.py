"""AsyncEngine: the EngineCore loop in a background thread, behind a message boundary.

The asyncio side only puts messages (add / abort) into an inbox and reads RequestOutputs from one
asyncio.Queue per request; the engine thread never touches asyncio objects except through
`loop.call_soon_threadsafe`. Moving the loop to its own process changes only this file.
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import (EngineDeadError, EngineOverloadedError, EngineRequest,
                                          RequestOutput)
from specserve.scheduler.messages import StepStats

logger = logging.getLogger(__name__)
_STOP = object()
DRAIN_WINDOW = 64


class AsyncEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None):
        self.config = config
        self.core = core or EngineCore(config)
        self.model_info = self.core.model_info
        self.engine_info = self.core.engine_info
        self.on_step: Callable[[StepStats], None] | None = None     # metrics hook, engine thread
        # called once on the engine thread after the loop died and every stream was failed
        self.on_death: Callable[[BaseException], None] | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._busy = False                        # the engine thread is inside a step
        self._completions: deque[float] = deque(maxlen=DRAIN_WINDOW)   # finish times
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    # -- asyncio side ------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Validate and enqueue; raises before anything is yielded (ParamError, overload, dead)."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        self.core.validate(request)
        waiting = self.core.scheduler.num_waiting + self._inbox.qsize()
        if waiting >= self.config.waiting_bound:
            raise EngineOverloadedError(f"{waiting} requests are already waiting",
                                        retry_after_s=self.drain_estimate_s(waiting))
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"duplicate request id {request.request_id}")
            self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", request))
        return self._iterate(request.request_id, stream)

    async def _iterate(self, request_id: str,
                       stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:                      # the consumer went away: free its KV
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block the calling thread (never the event loop) until the engine has nothing to run,
        release or deliver; False on timeout or when the engine died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._dead is None:
            with self._lock:
                streams = bool(self._streams)
            if not (streams or self._busy or self._inbox.qsize() or self.core.has_work()):
                return True
            time.sleep(0.01)
        return False

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    # -- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._drain(block=not self.core.has_work()):
                    return
                if self.core.has_work():
                    self._busy = True
                    step = self.core.step()
                    self._deliver(step.outputs)
                    if self.on_step is not None and step.stats is not None:
                        self.on_step(step.stats)
                self._busy = False
        except BaseException as exc:              # noqa: BLE001 — any escape kills the engine
            logger.exception("engine loop died")
            self._dead = exc
            with self._lock:
                streams = list(self._streams.values())
            for target in streams:
                _post(target, EngineDeadError(f"engine died: {exc}"))
            if self.on_death is not None:              # the server exits (vLLM's behaviour)
                self.on_death(exc)

    def _drain(self, block: bool) -> bool:
        while True:
            try:
                msg = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            self._busy = True                     # a message is being handled
            if msg is _STOP:
                return False
            kind, payload = msg
            if kind == "add":
                try:
                    self.core.add_request(payload)
                except Exception as exc:          # validated already; a race such as a duplicate id
                    self._deliver_error(payload.request_id, exc)
            else:
                out = self.core.abort_request(payload)
                if out is not None:
                    self._deliver([out])

    def drain_estimate_s(self, waiting: int) -> int:
        """Seconds until `waiting` requests would be served at the measured completion rate (the
        last DRAIN_WINDOW completions), clamped to [1, 600]; 5 before anything finished."""
        done = list(self._completions)
        if len(done) < 2 or done[-1] <= done[0]:
            return 5
        rate = (len(done) - 1) / (done[-1] - done[0])            # requests per second
        return max(1, min(600, math.ceil(waiting / rate)))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._completions.append(time.monotonic())
            with self._lock:
                target = self._streams.get(out.request_id)
            if target is not None:
                _post(target, out)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            _post(target, exc)


def _post(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: object) -> None:
    loop, stream = target
    try:
        loop.call_soon_threadsafe(stream.put_nowait, item)
    except RuntimeError:                          # the consumer's loop is closed: nobody to tell
        pass
