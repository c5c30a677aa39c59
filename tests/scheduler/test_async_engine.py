import asyncio
import math

import pytest

from specserve.scheduler.async_engine import AsyncEngine
from specserve.scheduler.messages import EngineDeadError, EngineOverloadedError, EngineRequest
from specserve.spec_phases.sampling_params import ParamError, SamplingParams


@pytest.fixture
def engine(engines):
    return engines.async_engine(model="tiny-random", kv_cache_memory_gb=0.05)


def req(rid, n=20, max_tokens=10):
    return EngineRequest(rid, [3 + (7 * i) % 300 for i in range(n)],
                         SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def collect(engine, request):
    tokens, last = [], None
    async for out in engine.submit(request):
        tokens.extend(out.new_token_ids)
        last = out
    return tokens, last


def test_concurrent_requests_stream_to_completion(engine):
    async def main():
        return await asyncio.gather(*(collect(engine, req(f"c{i}", n=5 + i)) for i in range(5)))
    results = asyncio.run(main())
    assert all(len(t) == 10 and last.finished and last.finish_reason == "length" for t,
               last in results)


def test_consumer_leaving_early_aborts_and_frees(engine):
    async def main():
        stream = engine.submit(req("gone", max_tokens=200))
        async for out in stream:
            if out.new_token_ids:
                break
        await stream.aclose()
    asyncio.run(main())
    assert engine.wait_idle(timeout=30)
    assert not engine.core.has_unfinished()
    engine.check_integrity()


def test_validation_and_overload_raise_before_streaming(engines):
    eng = engines.async_engine(model="tiny-random", kv_cache_memory_gb=0.05, max_waiting_requests=1,
                               max_model_len=64)

    async def main():
        with pytest.raises(ParamError):
            eng.submit(req("long", n=70))
        eng._pending.add("queued")                          # a full queue, as the engine sees it
        with pytest.raises(EngineOverloadedError):
            eng.submit(req("x"))
        eng._pending.clear()
    asyncio.run(main())


def test_dead_engine_fails_streams_and_new_submits(engine, monkeypatch):
    def explode():
        raise SystemError("kaput")
    deaths = []
    engine.on_death = deaths.append                          # the server stops and exits 1 here

    async def main():
        monkeypatch.setattr(engine.core, "step", explode)
        with pytest.raises(EngineDeadError):
            await collect(engine, req("d"))
        assert engine.is_dead
        assert len(deaths) == 1 and isinstance(deaths[0], SystemError)
        with pytest.raises(EngineDeadError):
            engine.submit(req("after"))
    asyncio.run(main())
    engine.core.scheduler.abort("d")                        # the dead loop left it behind


def test_the_queue_is_bounded_by_default_and_retry_after_follows_the_drain_rate(engines):
    """Issue 19 D4: with no flag the waiting queue holds 2 x max_num_seqs; a refusal carries the
    engine's estimate of how long every accepted request takes to finish: the output tokens they
    may still produce at the measured rate (the warm-up's rate before real steps are measured)."""
    eng = engines.async_engine(model="tiny-random", kv_cache_memory_gb=0.05, max_num_seqs=3)
    assert eng.config.max_waiting_requests is None and eng.config.waiting_bound == 6
    assert eng.decode_rate_prior == 0.0 and eng.drain_estimate_s() == 5   # nothing measured
    warm = engines.async_engine(model="tiny-random", kv_cache_memory_gb=0.05, max_num_seqs=3,
                                warm_up=True)
    assert warm.decode_rate_prior > 0 and warm.drain_rate() == warm.decode_rate_prior
    assert warm.drain_estimate_s() == 1                   # nothing outstanding: the floor

    async def main():
        await asyncio.gather(*(collect(warm, req(f"w{i}", max_tokens=3)) for i in range(6)))
        measured = warm.drain_rate()
        runs = [asyncio.ensure_future(collect(warm, req(f"q{i}", max_tokens=60)))
                for i in range(3)]
        await asyncio.sleep(0)
        for i in range(6):                                # a full queue, as the engine sees it
            warm._pending.add(f"queued{i}")
        with pytest.raises(EngineOverloadedError) as refused:
            warm.submit(req("over"))
        warm._pending.clear()
        await asyncio.gather(*runs)
        return measured, refused.value.retry_after_s
    measured, retry_after = asyncio.run(main())
    assert measured > 0
    # at most 3 x 60 tokens outstanding, at a rate no lower than the slower of prior and measured
    assert 1 <= retry_after <= math.ceil(180 / min(measured, warm.decode_rate_prior)) + 1
    assert warm.wait_idle() and warm.drain_estimate_s() == 1   # nothing left outstanding
    assert AsyncEngine.estimate_s(2400, 100.0) == 24 and AsyncEngine.estimate_s(10**9, 1.0) == 600
    assert AsyncEngine.estimate_s(0, 100.0) == 1 and AsyncEngine.estimate_s(50, 0.0) == 5


def test_engine_process_streams_aborts_and_matches_the_thread(engines):
    """The engine core in its own process (the server's default) gives the same tokens as on a
    thread, frees an abandoned stream's KV, and answers the integrity check across the pipe."""
    cfg = dict(model="tiny-random", kv_cache_memory_gb=0.05)
    proc = engines.async_engine(process=True, **cfg)
    thread = engines.async_engine(**cfg)
    assert proc.core is None and proc.model_info == thread.model_info
    assert proc.engine_info == thread.engine_info

    async def main(eng):
        results = await asyncio.gather(*(collect(eng, req(f"p{i}", n=5 + i)) for i in range(4)))
        stream = eng.submit(req("gone", max_tokens=200))
        async for out in stream:
            if out.new_token_ids:
                break
        await stream.aclose()
        return [tokens for tokens, _ in results]
    assert asyncio.run(main(proc)) == asyncio.run(main(thread))
    assert proc.wait_idle(timeout=30)
    proc.check_integrity()
    assert proc.num_waiting == 0


def test_engine_process_death_fails_streams_and_calls_on_death(engines):
    eng = engines.async_engine(process=True, model="tiny-random", kv_cache_memory_gb=0.05)
    deaths = []
    eng.on_death = deaths.append

    async def main():
        stream = eng.submit(req("victim", max_tokens=100000 // 100))
        async for out in stream:
            if out.new_token_ids:
                eng._host._process.kill()             # the engine process is OOM-killed, say
                break
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            eng.submit(req("after"))
    asyncio.run(main())
    assert eng.is_dead and len(deaths) == 1


def test_engine_process_start_failure_is_one_clear_error():
    from specserve.scheduler.async_engine import AsyncEngine
    from specserve.scheduler.config import EngineConfig
    with pytest.raises(ValueError, match="too small"):
        AsyncEngine(EngineConfig(model="tiny-random", kv_cache_memory_gb=1e-9), process=True)


def test_fault_hook_in_the_engine_process_step_then_loop(engines):
    """The documented fault hook reaches the engine process: a model-step fault fails that step's
    request and the engine serves the next one; a loop fault kills the engine, fails the stream
    and calls on_death."""
    eng = engines.async_engine(process=True, model="tiny-random", kv_cache_memory_gb=0.05)
    deaths = []
    eng.on_death = deaths.append

    async def main():
        eng.inject_fault("step")
        tokens, last = await collect(eng, req("faulted"))
        assert last.finish_reason == "error" and "injected fault" in last.error
        tokens, last = await collect(eng, req("fine"))
        assert len(tokens) == 10 and last.finish_reason == "length"
        eng.inject_fault("loop")
        with pytest.raises(EngineDeadError, match="injected fault in the engine loop"):
            await collect(eng, req("after-loop-fault"))
    asyncio.run(main())
    assert eng.is_dead and len(deaths) == 1
    with pytest.raises(ValueError):
        engines.core(model="tiny-random", kv_cache_memory_gb=0.05).inject_fault("nowhere")
