"""AsyncEngine: the EngineCore loop behind a message boundary, in its own process or a thread.

The asyncio side validates, then sends plain messages (add / abort / check / stop); the loop
(`run_loop`) sends back plain events (outputs, stats, idle, ...). Both directions are picklable
data, so the same loop runs in two hosts:
- `ProcessHost` (the server's default): the engine core in a spawned process, as vLLM v1 splits
  it, so tokenization, detokenization, SSE and the step loop never share a GIL. Messages cross a
  pipe; a reader thread in this process turns events into stream items.
- `ThreadHost`: the loop on a thread of this process (the offline `LLM` and most tests; `core` is
  reachable for white-box checks).
The asyncio side never blocks on the engine: events reach each request's asyncio.Queue through
`loop.call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from specserve.scheduler.config import EngineConfig
from specserve.scheduler.messages import (EngineDeadError, EngineInfo, EngineOverloadedError,
                                          EngineRequest, ModelInfo, RequestOutput, StepStats)
from specserve.scheduler.validation import validate

if TYPE_CHECKING:       # imported where a core is built: with the core in its own process the
    from specserve.scheduler.engine import EngineCore      # server never loads torch
logger = logging.getLogger(__name__)
RATE_WINDOW = 64                   # steps whose rate the drain estimate reads
MIN_RATE_SECONDS = 0.5             # of step time, before the measured rate replaces the prior
STARTUP_TIMEOUT_S = 900.0          # first-start calibration of lossy_kv can take minutes
# a refusal while the engine process starts is raised again here as its base class (the CLI
# prints these as one line): an unsupported model (ValueError), a missing file
STARTUP_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


# -- the loop, wherever it runs ------------------------------------------------------------------
def run_loop(core: EngineCore, recv: Callable[[bool], Any], emit: Callable[[tuple], None]) -> None:
    """Step while there is work; between steps handle every message that arrived. `recv(block)`
    returns the next message (None: none yet, when not blocking); `emit` sends an event. Returns
    on ("stop",); any exception escapes (the host reports the death)."""
    handled = 0
    while True:
        block = not core.has_work()
        if block:
            emit(("idle", handled))
        while True:
            msg = recv(block)
            if msg is None:
                break
            block = False
            handled += 1
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "add":
                try:
                    core.add_request(msg[1])
                except Exception as exc:          # validated already; a race such as a duplicate id
                    emit(("add_failed", msg[1].request_id, f"{type(exc).__name__}: {exc}"))
            elif kind == "abort":
                out = core.abort_request(msg[1])
                if out is not None:
                    emit(("outputs", [out]))
            elif kind == "check":
                emit(("checked", _integrity_error(core)))
            elif kind == "fault":
                core.inject_fault(msg[1])
        if core.has_work():
            step = core.step()
            if step.outputs or step.stats is not None:
                emit(("step", step.outputs, step.stats))


def _integrity_error(core: EngineCore) -> str | None:
    try:
        core.check_integrity()
    except AssertionError as exc:
        return str(exc) or "integrity check failed"
    return None


# -- hosts ---------------------------------------------------------------------------------------
class ThreadHost:
    """The loop on a daemon thread of this process."""

    def __init__(self, core: EngineCore, on_event: Callable[[tuple], None], warm_up: bool):
        self.core = core
        self.model_info, self.engine_info = core.model_info, core.engine_info
        self.decode_rate = core.warm_up() if warm_up else 0.0
        self._on_event = on_event
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def send(self, msg: tuple) -> None:
        self._inbox.put(msg)

    def _recv(self, block: bool) -> Any:
        try:
            return self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        try:
            run_loop(self.core, self._recv, self._on_event)
        except BaseException as exc:              # noqa: BLE001 — any escape kills the engine
            logger.exception("engine loop died")
            self._on_event(("dead", exc))

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class ProcessHost:
    """The loop in a spawned child process; a reader thread here receives its events."""

    def __init__(self, config: EngineConfig, on_event: Callable[[tuple], None], warm_up: bool):
        self.core = None
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._send_lock = threading.Lock()
        self._process = ctx.Process(target=_process_main, args=(config, child, warm_up),
                                    name="specserve-engine-core", daemon=True)
        self._process.start()
        child.close()
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {STARTUP_TIMEOUT_S} s")
        try:
            event = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited while starting "
                               f"(exit code {self._process.exitcode})") from None
        if event[0] == "failed":
            self._process.join(5)
            raise STARTUP_ERRORS.get(event[1], RuntimeError)(event[2])
        _, self.model_info, self.engine_info, self.decode_rate = event
        self._on_event = on_event
        self._reader = threading.Thread(target=self._read, name="specserve-engine-events",
                                        daemon=True)
        self._reader.start()

    def send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):             # the process is gone; the reader reports it
            pass

    def _read(self) -> None:
        while True:
            try:
                event = self._conn.recv()
            except (EOFError, OSError):
                self._process.join(5)             # reaped, or exitcode would still read None
                code = self._process.exitcode
                if code != 0:
                    logger.error("the engine process exited with code %s", code)
                    self._on_event(("dead", RuntimeError(f"engine process exited ({code})")))
                return
            if event[0] == "dead":
                self._on_event(("dead", RuntimeError(event[1])))
                return
            self._on_event(event)

    def join(self, timeout: float) -> None:
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(1)


def _process_main(config: EngineConfig, conn, warm_up: bool) -> None:
    """The engine process: build the core (and warm it up), report ready (or why not), run the
    loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # the server process decides when to stop
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        from specserve.scheduler.engine import EngineCore
        core = EngineCore(config)
        rate = core.warm_up() if warm_up else 0.0
    except BaseException as exc:                          # noqa: BLE001 — reported, then exit
        kind = next((c.__name__ for c in STARTUP_ERRORS.values() if isinstance(exc, c)),
                    type(exc).__name__)
        conn.send(("failed", kind, str(exc)))
        return
    conn.send(("ready", core.model_info, core.engine_info, rate))

    def recv(block: bool) -> Any:
        if not block and not conn.poll():
            return None
        try:
            return conn.recv()
        except EOFError:                                  # the server process is gone
            return ("stop",)
    try:
        run_loop(core, recv, conn.send)
    except BaseException as exc:                          # noqa: BLE001 — reported, then exit
        logger.exception("engine loop died")
        try:
            conn.send(("dead", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass


# -- the asyncio side ----------------------------------------------------------------------------
class AsyncEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None,
                 process: bool = False, warm_up: bool = False):
        """process: run the engine core in its own process (`ProcessHost`); else on a thread.
        warm_up: run `EngineCore.warm_up` before serving (the server does; its rate is the drain
        estimate's prior)."""
        self.config = config
        self.on_step: Callable[[StepStats], None] | None = None     # metrics hook, reader thread
        # called once after the engine died and every stream was failed
        self.on_death: Callable[[BaseException], None] | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._pending: set[str] = set()           # submitted, not yet scheduled once
        self._sent = 0                            # messages sent to the loop
        self._handled = -1                        # messages the loop had handled when last idle
        self._checked: queue.SimpleQueue = queue.SimpleQueue()
        # the drain estimate: output tokens each unfinished request may still produce, and the
        # (tokens, seconds) of recent steps
        self._outstanding: dict[str, int] = {}
        self._steps: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)
        if process:
            self._host: ThreadHost | ProcessHost = ProcessHost(config, self._on_event, warm_up)
        else:
            if core is None:
                from specserve.scheduler.engine import EngineCore
                core = EngineCore(config)
            self._host = ThreadHost(core, self._on_event, warm_up)
        self.decode_rate_prior: float = self._host.decode_rate     # tokens/s; 0: not measured
        self.core = self._host.core
        self.model_info: ModelInfo = self._host.model_info
        self.engine_info: EngineInfo = self._host.engine_info

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def num_waiting(self) -> int:
        """Requests accepted and not yet scheduled for the first time."""
        return len(self._pending)

    def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Validate and enqueue; raises before anything is yielded (ParamError, overload, dead)."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        validate(request, self.model_info)
        waiting = self.num_waiting
        if waiting >= self.config.waiting_bound:
            raise EngineOverloadedError(f"{waiting} requests are already waiting",
                                        retry_after_s=self.drain_estimate_s())
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"duplicate request id {request.request_id}")
            self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
            self._pending.add(request.request_id)
            self._outstanding[request.request_id] = request.sampling_params.max_tokens
        self._send(("add", request))
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
                self._pending.discard(request_id)
                self._outstanding.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, msg: tuple) -> None:
        with self._lock:
            self._sent += 1
        self._host.send(msg)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block the calling thread (never the event loop) until the engine has nothing to run,
        release or deliver; False on timeout or when the engine died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._dead is None:
            with self._lock:
                idle = not self._streams and self._handled == self._sent
            if idle:
                return True
            time.sleep(0.01)
        return False

    def check_integrity(self, timeout: float = 30.0) -> None:
        """Ask the loop to check every pool balances (call when idle); AssertionError if not."""
        self._send(("check",))
        error = self._checked.get(timeout=timeout)
        if error is not None:
            raise AssertionError(error)

    def inject_fault(self, where: str) -> None:
        """Test-only: `EngineCore.inject_fault` in whichever process the loop runs."""
        self._send(("fault", where))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._send(("stop",))
        self._host.join(timeout)

    def drain_rate(self) -> float:
        """Output tokens per second of busy engine time over the last RATE_WINDOW steps (prefills
        included), or the warm-up's decode rate until those steps hold MIN_RATE_SECONDS."""
        with self._lock:
            tokens = sum(t for t, _ in self._steps)
            seconds = sum(s for _, s in self._steps)
        if seconds >= MIN_RATE_SECONDS and tokens:
            return tokens / seconds
        return self.decode_rate_prior

    def drain_estimate_s(self) -> int:
        """Seconds until every accepted request (running and waiting) would be done: the output
        tokens they may still produce (their max_tokens left) at `drain_rate`, clamped to
        [1, 600]; 5 when no rate was measured."""
        with self._lock:
            tokens = sum(self._outstanding.values())
        return self.estimate_s(tokens, self.drain_rate())

    @staticmethod
    def estimate_s(tokens: int, rate: float) -> int:
        return 5 if rate <= 0 else max(1, min(600, math.ceil(tokens / rate)))

    # -- events, on the engine thread or the reader thread ---------------------------------------
    def _on_event(self, event: tuple) -> None:
        kind = event[0]
        if kind == "step":
            stats: StepStats | None = event[2]
            if stats is not None:
                with self._lock:
                    self._pending.difference_update(stats.first_scheduled)
                    self._steps.append((stats.num_generation_tokens, stats.step_time_s))
            self._deliver(event[1])
            if stats is not None and self.on_step is not None:
                self.on_step(stats)
        elif kind == "outputs":
            self._deliver(event[1])
        elif kind == "idle":
            with self._lock:
                self._handled = event[1]
        elif kind == "add_failed":
            self._fail(event[1], RuntimeError(event[2]))
        elif kind == "checked":
            self._checked.put(event[1])
        elif kind == "dead":
            self._die(event[1])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                if out.finished:
                    self._pending.discard(out.request_id)
                    self._outstanding.pop(out.request_id, None)
                elif out.request_id in self._outstanding:
                    self._outstanding[out.request_id] -= len(out.new_token_ids)
                target = self._streams.get(out.request_id)
            if target is not None:
                _post(target, out)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            self._pending.discard(request_id)
            self._outstanding.pop(request_id, None)
            target = self._streams.get(request_id)
        if target is not None:
            _post(target, exc)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        if self.on_death is not None:              # the server exits (vLLM's behaviour)
            self.on_death(exc)
        with self._lock:
            streams = list(self._streams.values())
        for target in streams:
            _post(target, EngineDeadError(f"engine died: {exc}"))
        self._checked.put("the engine died")


def _post(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: object) -> None:
    loop, stream = target
    try:
        loop.call_soon_threadsafe(stream.put_nowait, item)
    except RuntimeError:                          # the consumer's loop is closed: nobody to tell
        pass
