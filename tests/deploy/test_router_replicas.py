"""Two real `specserve serve` replicas (the tiny random-weight model) behind vLLM's router
(`vllm-router`, installed by the test extra): shared prefixes land where they are cached, and a
replica killed under load loses at most the requests in flight on it, none started after, and
rejoins when restarted. `python -m loadtests.router` is the same run, larger, on the
embedded model (docs/deploy.md has its figures). No timing assertions: the timeouts are hang
guards."""
from __future__ import annotations

import pytest

from loadtests import router

pytestmark = pytest.mark.timeout(1200)


def test_router_routes_by_prefix_survives_a_killed_replica_and_takes_it_back(tmp_path):
    summary = router.run("tiny-random", replicas=2, groups=3, per_group=4, prefix_words=120,
                         max_tokens=8, kill_requests=24, concurrency=4,
                         server_args=["--max-model-len", "1024", "--kv-cache-memory-gb", "0.05"],
                         log_dir=tmp_path)
    cache_aware, round_robin = summary["prefix"]
    assert (cache_aware["policy"], round_robin["policy"]) == ("cache_aware", "round_robin")
    for phase in (cache_aware, round_robin):
        assert phase["ok"] == phase["requests"] == 12, phase
        assert sum(phase["per_replica"]) == 12, phase
    # round_robin alternates, so each group's prefix is computed on both replicas; cache_aware
    # sends a group's later prompts to the replica that computed its prefix
    assert round_robin["per_replica"] == [6, 6], round_robin
    assert cache_aware["router_decisions"].get("prefix_hit", 0) >= 3 * (4 - 1), cache_aware
    assert cache_aware["hit_rate"] > round_robin["hit_rate"], summary["prefix"]

    kill = summary["kill"]
    assert kill["requests"] == 24 and kill["started_after_kill"] > 0, kill
    assert kill["lost_started_after_kill"] == 0, kill           # every new request succeeds
    # only what was in flight can be lost (at most `concurrency` requests were)
    assert kill["lost_started_before_kill"] <= 4, kill
    assert kill["rejoined"] and kill["lost_after_restart"] == 0, kill
