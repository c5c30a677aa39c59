"""A deterministic fake engine and a real uvicorn server on 127.0.0.1 around it.

The fake speaks the engine boundary exactly (scheduler/messages.py): `submit` returns an async
iterator of `RequestOutput` deltas, `abort` is idempotent. It "generates" the tokens of SCRIPT in a
cycle (from a seed-chosen start when a seed is given, from 0 when greedy), ends with EOS after the
script's last token (unless ignore_eos), and honours max_tokens, min_tokens, stop_token_ids and
logprobs. It records every request so tests can assert that none is left holding blocks.
"""
from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import pytest
import httpx
import uvicorn

from specserve.scheduler.messages import (EngineDeadError, EngineOverloadedError, ModelInfo,
                                          RequestOutput,
                                          TokenLogprob)
from specserve.server.app import build_app
from specserve.server.settings import ServerSettings
from specserve.server.tokenizer import load_tokenizer

SCRIPT = " The quick brown fox jumps over the lazy dog. Hello, 世界! Paris is the capital of France."
EOS = 2
MODEL = "fake-model"


class FakeEngine:
    def __init__(self, tokenizer, max_model_len: int = 512, step_delay: float = 0.0,
                 max_waiting: int = 10_000, tokens_per_step: int = 1):
        self.script_ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.model_info = ModelInfo(name=MODEL, path="/models/fake.gguf", vocab_size=len(tokenizer),
                                    max_model_len=max_model_len, eos_token_ids=(EOS,),
                                    bos_token_id=1)
        self.step_delay = step_delay
        self.max_waiting = max_waiting
        self.tokens_per_step = tokens_per_step
        self.is_dead = False
        self.error_after: int | None = None       # finish with "error" after this many tokens
        self.raise_on_first_step: Exception | None = None
        self.submitted: list = []
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.shut_down = False

    # -- the engine boundary -------------------------------------------------------------------
    def submit(self, request):
        if self.is_dead:
            raise EngineDeadError("dead")
        if len(self.held()) >= self.max_waiting:
            raise EngineOverloadedError("queue full")
        self.submitted.append(request)
        return self._generate(request)

    def abort(self, request_id: str) -> None:
        if request_id not in self.finished:
            self.aborted.add(request_id)

    def shutdown(self) -> None:
        self.shut_down = True

    # -- test helpers ----------------------------------------------------------------------------
    def held(self) -> set[str]:
        """Requests that would still hold KV blocks: submitted, neither finished nor aborted."""
        return {r.request_id for r in self.submitted} - self.aborted - self.finished

    def expected_ids(self, start: int, count: int) -> list[int]:
        return [self.script_ids[(start + j) % len(self.script_ids)] for j in range(count)]

    def start_for(self, params) -> int:
        if params.seed is not None:
            return random.Random(params.seed).randrange(len(self.script_ids))
        if params.temperature == 0:
            return 0
        return random.randrange(len(self.script_ids))

    @staticmethod
    def logprob(token_id: int, n: int) -> TokenLogprob:
        top = [token_id] + [(token_id + k) % 49152 for k in range(1, n)]
        return TokenLogprob(token_id, -0.25, 1, top[:n], [-0.25 - k for k in range(n)])

    async def _generate(self, request):
        params, rid = request.sampling_params, request.request_id
        start, length = self.start_for(params), len(self.script_ids)
        num_generated, first = 0, True
        while True:
            await asyncio.sleep(self.step_delay)
            if rid in self.aborted:
                return
            if self.raise_on_first_step is not None and first:
                raise self.raise_on_first_step
            new_ids, finish, stop_reason = [], None, None
            for _ in range(self.tokens_per_step):
                position = start + num_generated
                at_eos = position % length == 0 and num_generated > 0 and not params.ignore_eos
                token = EOS if at_eos and num_generated >= params.min_tokens else \
                    self.script_ids[position % length]
                new_ids.append(token)
                num_generated += 1
                if token == EOS:
                    finish = "stop"
                elif token in params.stop_token_ids and num_generated > params.min_tokens:
                    finish, stop_reason = "stop", token
                elif num_generated >= params.max_tokens:
                    finish = "length"
                if self.error_after is not None and num_generated >= self.error_after:
                    finish = "error"
                if finish:
                    break
            logprobs = None
            if params.logprobs is not None:
                logprobs = [self.logprob(t, params.logprobs) for t in new_ids]
            prompt_logprobs = None
            if first and params.prompt_logprobs is not None:
                prompt_logprobs = [None] + [self.logprob(t, params.prompt_logprobs)
                                            for t in request.prompt_token_ids[1:]]
            out = RequestOutput(rid, new_ids, finished=finish is not None, finish_reason=finish,
                                stop_reason=stop_reason, new_logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs,
                                num_prompt_tokens=len(request.prompt_token_ids) if first else 0,
                                error="injected failure" if finish == "error" else None)
            first = False
            if finish is not None:
                self.finished.add(rid)
            yield out
            if finish is not None:
                return


class LiveServer:
    """uvicorn on 127.0.0.1 with a free port, in a thread (the app's loop lives there)."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30          # a hang guard, not a timing assertion
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def wait_until(predicate, what: str, limit_s: float = 30.0) -> None:
    """Poll until `predicate()` holds; the limit only stops a hang (never a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for: {what}"
        time.sleep(0.01)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture
def fake_engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture
def make_server(tokenizer):
    """make_server(engine=None, **settings) -> LiveServer (started; stopped after the test)."""
    servers = []

    def make(engine=None, routers=(), **overrides):
        engine = engine or FakeEngine(tokenizer)
        settings = ServerSettings(**{"served_model_names": (MODEL, "fake-alias"),
                                     "sse_keepalive_s": 0,
                                     **overrides})
        server = LiveServer(build_app(engine, tokenizer, settings, routers=routers)).__enter__()
        server.engine = engine
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def server(make_server, fake_engine):
    return make_server(fake_engine)


@pytest.fixture
def wait_healthy():
    """Wait until a `specserve serve` subprocess answers /health with 200 (it must stay alive;
    its log is the failure message)."""
    def wait(proc, url: str, log) -> None:
        deadline = time.monotonic() + 240              # a hang guard, not a timing assertion
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
    return wait
