"""The streaming client against a tiny fake OpenAI server on 127.0.0.1 (no timing assertions)."""
import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtests.client import (RequestSpec, first_model_id, run_closed_loop, run_open_loop,
                                        stream_completion)
from loadtests.metrics import scrape
from loadtests.stats import summarize
import httpx

METRICS = 'vllm:spec_decode_num_drafts_total{engine="0",model_name="fake"} 4.0\n'


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams max_tokens chunks of "t"; the prompt selects misbehaviour."""

    protocol_version = "HTTP/1.0"                    # body ends when the connection closes
    bodies: list = []

    def log_message(self, *args):
        pass

    def _send(self, status, body, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200,
                       json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}))
        elif self.path == "/metrics":
            self._send(200, METRICS, "text/plain; version=0.0.4")
        else:
            self._send(404, "{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.bodies.append(body)
        prompt = body["prompt"]
        if prompt == "reject":
            return self._send(400, json.dumps({"error": {"message": "bad", "code": 400}}))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        write = lambda obj: self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.write(b": keep-alive\n\n")
        per_chunk = 2 if prompt == "spec" else 1    # speculation: several tokens per chunk
        n = body["max_tokens"]
        for i in range(0, n, per_chunk):
            write({"id": "c", "object": "text_completion",
                   "choices": [{"index": 0, "text": "t" * min(per_chunk, n - i),
                                "finish_reason": None}]})
            self.wfile.flush()
            if prompt == "stall" and i == 1:
                time.sleep(3.0)                      # long past the client's hard deadline
                return
        write({"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if prompt == "inband":
            write({"error": {"message": "boom", "type": "InternalServerError", "code": 500}})
        elif prompt == "truncated":
            return
        if prompt != "nousage" and body.get("stream_options", {}).get("include_usage"):
            write({"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                       "total_tokens": 7 + n}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def base_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _one(base_url, prompt, max_tokens=5, extra_body=None):
    async def go():
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            return await stream_completion(client, base_url, "fake",
                                           RequestSpec(prompt, max_tokens),
                                           extra_body)
    return asyncio.run(go())


def test_stream_counts_chunks_usage_and_gaps(base_url):
    r = _one(base_url, "hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert r.ok and r.error is None
    assert (r.num_chunks, r.completion_tokens, r.prompt_tokens) == (5, 5, 7)
    assert r.usage_reported and r.text == "ttttt"
    assert len(r.itls_s) == 4                        # gaps between 5 content chunks
    assert 0 <= r.ttft_s <= r.e2e_s
    sent = FakeOpenAI.bodies[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["ignore_eos"] is True and sent["temperature"] == 0.0


def test_multi_token_chunks_take_tokens_from_usage(base_url):
    r = _one(base_url, "spec", max_tokens=6)
    assert (r.num_chunks, r.completion_tokens) == (3, 6)


def test_missing_usage_falls_back_to_chunk_count(base_url):
    r = _one(base_url, "nousage", max_tokens=4)
    assert r.ok and not r.usage_reported and r.completion_tokens == 4


@pytest.mark.parametrize("prompt, error", [("reject", "HTTP 400"), ("inband", "in-band error"),
                                           ("truncated", "without [DONE]")])
def test_failures_are_reported_not_raised(base_url, prompt, error):
    r = _one(base_url, prompt)
    assert not r.ok and error in r.error


def test_closed_loop_sends_every_request_once(base_url):
    requests = [RequestSpec(f"p{i}", 3) for i in range(7)]
    load = asyncio.run(run_closed_loop(base_url, "fake", requests, concurrency=3, time_limit_s=60))
    assert len(load.results) == 7 and all(r.ok for r in load.results)
    assert sorted(r.text for r in load.results) == ["ttt"] * 7
    assert load.duration_s > 0


def test_closed_loop_stops_sending_at_the_time_limit(base_url):
    requests = [RequestSpec("p", 3) for _ in range(50)]
    load = asyncio.run(run_closed_loop(base_url, "fake", requests, concurrency=2, time_limit_s=0))
    assert load.results == []


def test_open_loop_skips_arrivals_after_the_limit(base_url):
    requests = [RequestSpec("p", 2, arrival_s=t) for t in (0.0, 0.01, 0.02, 500.0)]
    load = asyncio.run(run_open_loop(base_url, "fake", requests, time_limit_s=1.0))
    assert len(load.results) == 3 and all(r.ok for r in load.results)


def test_model_id_and_metrics_scrape(base_url):
    assert asyncio.run(first_model_id(base_url)) == "fake"

    async def go():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await scrape(client, base_url), await scrape(client, base_url + "/nothing")
    totals, missing = asyncio.run(go())
    assert totals == {"vllm:spec_decode_num_drafts_total": 4.0}
    assert missing is None


def test_requests_past_the_hard_deadline_are_cancelled_but_keep_their_tokens(base_url):
    load = asyncio.run(run_closed_loop(base_url, "fake", [RequestSpec("stall", 5)], concurrency=1,
                                       time_limit_s=0.1, grace_s=0.5))
    (r,) = load.results
    assert not r.ok and r.error == "cancelled"
    assert (r.num_chunks, r.completion_tokens) == (2, 2)
    s = summarize(load.results, load.duration_s)
    assert (s["num_completed"], s["num_cancelled"]) == (0, 1)
    assert s["output_tokens_per_s"] == 2 / load.duration_s
