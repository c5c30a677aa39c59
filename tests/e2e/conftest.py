"""A real uvicorn on 127.0.0.1 around the real AsyncEngine with the tiny random-weight model."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from specserve.scheduler.async_engine import AsyncEngine
from specserve.scheduler.config import EngineConfig
from specserve.server.app import build_app
from specserve.server.settings import ServerSettings
from specserve.server.tokenizer import load_tokenizer

NAME = "tiny"


class RealServer:
    def __init__(self, engine, tokenizer, **settings):
        self.engine = engine
        self.app = build_app(engine, tokenizer,
                             ServerSettings(served_model_names=(NAME,), sse_keepalive_s=0,
                                                               **settings))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self) -> RealServer:
        self.thread.start()
        deadline = time.monotonic() + 60             # hang guard only
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def wait_idle(self, limit_s: float = 120.0) -> None:
        deadline = time.monotonic() + limit_s        # hang guard only
        while self.app.state.serving.client.in_flight:
            assert time.monotonic() < deadline, "the server did not finish its requests"
            time.sleep(0.02)
        assert self.engine.wait_idle(max(deadline - time.monotonic(),
                                         1.0)), "engine did not go idle"
        self.engine.check_integrity()


@pytest.fixture(scope="session")
def real_server_type():
    """RealServer, for modules that build their own server (a `from conftest import` is ambiguous
    when the whole suite runs)."""
    return RealServer


@pytest.fixture(scope="module")
def real_server():
    engine = AsyncEngine(EngineConfig(model="tiny-random", max_model_len=256, num_kv_blocks=96,
                                      max_num_seqs=32, max_num_batched_tokens=512, num_threads=1))
    server = RealServer(engine, load_tokenizer("tiny-random")).start()
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture(autouse=True)
def integrity_after_each_test(request):
    yield
    if "real_server" in request.fixturenames:
        request.getfixturevalue("real_server").wait_idle()
