"""The server's side of the engine message boundary (scheduler/messages.py).

The server never holds an engine iterator directly: `EngineClient.open(requests)` submits one engine
request per choice and returns a `ChoiceStream` that merges their outputs. Whoever opens a stream
must close it (`async with`): closing aborts every engine request that has not finished, which is
how a client disconnect, a stop string or an error frees KV blocks within one engine step.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from specserve.scheduler.messages import (EngineDeadError, EngineOverloadedError, EngineRequest,
                                          ModelInfo, RequestOutput)
from specserve.spec_phases.sampling_params import ParamError

logger = logging.getLogger("specserve.server")
_END = object()


# submit() refusals: the request never started (counted apart from finished requests)
REJECTED = {EngineOverloadedError: "overloaded", EngineDeadError: "engine_dead",
            ParamError: "invalid"}


class RequestTimeout(Exception):
    """The request ran past `--request-timeout`; closing its stream aborts it and frees its KV."""

    def __init__(self, timeout_s: float | None):
        super().__init__(f"The request did not finish within the server's --request-timeout of "
                         f"{timeout_s:g} s; it was aborted.")


class EngineClient:
    """Wraps any object with the `EngineClientProtocol` methods (the real engine or a test fake):
    all of them, `is_dead` and `shutdown` included."""

    def __init__(self, engine, request_timeout_s: float | None = None):
        self.engine = engine
        # a request still running this long after it was opened fails with 504 and is aborted
        self.request_timeout_s = request_timeout_s
        self.in_flight: set[str] = set()        # engine request ids submitted and not yet done
        # (requests, n) -> RequestTracker | None (server/metrics.py)
        self.tracker_factory = None

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    @property
    def is_dead(self) -> bool:
        return self.engine.is_dead

    async def submit(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        outputs = self.engine.submit(request)
        self.in_flight.add(request.request_id)
        return outputs

    def abort(self, request_id: str) -> None:
        if request_id in self.in_flight:
            self.in_flight.discard(request_id)
            try:
                self.engine.abort(request_id)
            except Exception:                     # the engine may already be gone
                logger.exception("abort(%s) failed", request_id)

    def done(self, request_id: str) -> None:
        self.in_flight.discard(request_id)

    def open(self, requests: list[EngineRequest], n: int = 1) -> ChoiceStream:
        """`requests` are prompts × n choices, prompt-major (n matters only to request metrics)."""
        tracker = self.tracker_factory(requests, n) if self.tracker_factory is not None else None
        deadline = (None if self.request_timeout_s is None
                    else time.monotonic() + self.request_timeout_s)
        return ChoiceStream(self, requests, tracker, deadline)

    def shutdown(self) -> None:
        self.engine.shutdown()


class ChoiceStream:
    """Outputs of several engine requests, merged: `async for index, output in stream`.

    `index` is the position in `requests` (the choice index). `finish(index)` aborts one request
    early (a stop string matched). Exceptions raised by the engine come out of the iterator.
    """

    def __init__(self, client: EngineClient, requests: list[EngineRequest], tracker=None,
                 deadline: float | None = None):
        self.client = client
        self.deadline = deadline                  # time.monotonic(); None: no deadline
        self.requests = requests
        # request metrics; sees each output once, on arrival
        self.tracker = tracker
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pumps: list[asyncio.Task] = []
        self.finished: set[int] = set()
        self.num_open = len(requests)
        self.pushed: list[tuple[int, RequestOutput]] = []

    async def __aenter__(self) -> ChoiceStream:
        try:
            for index, request in enumerate(self.requests):
                outputs = await self.client.submit(request)
                self.pumps.append(asyncio.create_task(self._pump(index, outputs)))
        except BaseException as exc:
            reason = REJECTED.get(type(exc))
            if reason is not None and self.tracker is not None:
                self.tracker.rejected(reason)
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _pump(self, index: int, outputs: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in outputs:
                await self.queue.put((index, output))
                if output.finished:
                    break
        except asyncio.CancelledError:
            raise
        # surfaces in the consumer, which maps it to a status
        except BaseException as exc:
            await self.queue.put((index, exc))
        finally:
            try:
                await outputs.aclose()
            except BaseException:
                pass
        await self.queue.put((index, _END))

    def __aiter__(self):
        return self

    def unget(self, item: tuple[int, RequestOutput]) -> None:
        """Put an item back so that the next `__anext__` returns it first."""
        self.pushed.append(item)

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self.pushed:
            return self.pushed.pop()
        while self.num_open > 0:
            index, item = await self._next_item()
            if item is _END:
                self.num_open -= 1
                self._mark_done(index)
                continue
            if index in self.finished:
                continue                          # late output of a request we already stopped
            if isinstance(item, BaseException):
                if self.tracker is not None:
                    self.tracker.failed(index)
                raise item
            if self.tracker is not None:
                self.tracker.output(index, item)
            if item.finished:
                self._mark_done(index)
            return index, item
        raise StopAsyncIteration

    async def _next_item(self) -> tuple[int, object]:
        if self.deadline is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), self.deadline - time.monotonic())
        except TimeoutError:
            if self.tracker is not None:
                for index in range(len(self.requests)):
                    if index not in self.finished:
                        self.tracker.failed(index)
            raise RequestTimeout(self.client.request_timeout_s) from None

    def _mark_done(self, index: int) -> None:
        if index not in self.finished:
            self.finished.add(index)
            self.client.done(self.requests[index].request_id)

    def finish(self, index: int) -> None:
        """Stop one choice early: abort its engine request now (idempotent)."""
        if index not in self.finished:
            self.finished.add(index)
            self.client.abort(self.requests[index].request_id)
            if self.tracker is not None:
                self.tracker.stopped(index)

    async def close(self) -> None:
        for index, request in enumerate(self.requests):
            if index not in self.finished:
                self.finished.add(index)
                self.client.abort(request.request_id)
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        for task in self.pumps:
            task.cancel()
        for task in self.pumps:
            try:
                await task
            except BaseException:
                pass
        self.pumps.clear()
