"""The worker in another process, reached through the step contract alone: a spawned process
builds a `Worker`, sends its `WorkerFacts` once, then answers each pickled `StepPlan` with its
`StepResult`. The engine here is the real `EngineCore` (scheduler, KV manager, grammar manager)
given a proxy that has nothing but those messages (and an integrity check on request). Its text
equals an in-process `EngineCore`'s on the same requests: greedy and seeded sampling under n-gram
drafts, a choice and a JSON-schema request whose grammars the engine compiled and the plans
carried, drafts accepted under the schema."""
import json
import multiprocessing

import jsonschema

from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.plan import DrafterTiming, StepPlan, StepResult, WorkerFacts
from specserve.spec_phases.sampling_params import Constraint, SamplingParams
from specserve.spec_phases.tokenizer import load_tokenizer

CONFIG = EngineConfig(model="tiny-random", kv_cache_memory_gb=0.05, max_model_len=256,
                      num_threads=1, speculative=SpeculativeConfig(
                          method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                          prompt_lookup_max=3))
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
REPLY_TIMEOUT_S = 300               # a dead child fails the test instead of hanging it


def requests(tok) -> list[EngineRequest]:
    examples = tok.encode('{"ok": true, "n": 12} {"ok": false, "n": 7} {"ok": true, "n": 12}')
    return [
        EngineRequest("greedy", [11, 12, 13, 14, 15] * 4,
                      SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
        EngineRequest("seeded", [7, 8, 9, 10] * 3,
                      SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)),
        EngineRequest("choice", [5, 6, 7],
                      SamplingParams(max_tokens=8, temperature=0,
                                     constraint=Constraint("choice", choices=("yes", "no")))),
        EngineRequest("schema", examples,
                      SamplingParams(max_tokens=40, temperature=0, constraint=Constraint(
                          "json_schema", json.dumps(SCHEMA)))),
    ]


def worker_main(config: EngineConfig, conn) -> None:
    """The worker's side: its facts once, then a reply to every message until None."""
    from specserve.spec_phases.worker import Worker
    worker = Worker(config.worker_config())
    conn.send(worker.facts())
    while (message := conn.recv()) is not None:
        kind, *args = message
        try:
            if kind == "plan":
                conn.send(worker.execute(*args))
            elif kind == "calibrate":
                conn.send(worker.calibrate_drafter())
            else:                                               # "check"
                worker.check_integrity(*args)
                conn.send(None)
        except Exception as exc:                                # noqa: BLE001 - sent back
            conn.send(exc)


class ProcessWorker:
    """The engine's worker, in a spawned process: only pickled messages cross."""

    def __init__(self, config: EngineConfig):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(config, child), daemon=True)
        self.process.start()
        self._facts = self._reply()
        self.plans: list[StepPlan] = []

    def _reply(self):
        assert self.conn.poll(REPLY_TIMEOUT_S), "the worker process did not answer"
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def facts(self) -> WorkerFacts:
        return self._facts

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.conn.send(("plan", plan))
        result = self._reply()
        assert isinstance(result, StepResult)
        return result

    def check_integrity(self, live_ids, releasing, reserved_bytes) -> None:
        self.conn.send(("check", live_ids, releasing, reserved_bytes))
        self._reply()

    def calibrate_drafter(self) -> DrafterTiming:
        self.conn.send(("calibrate",))
        return self._reply()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def serve(core: EngineCore, reqs: list[EngineRequest]):
    """Every request's tokens, finish reason and speculation counters."""
    for req in reqs:
        core.add_request(req)
    out = {r.request_id: [] for r in reqs}
    reasons, spec = {}, {}
    while core.has_work():
        step = core.step()
        for o in step.outputs:
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id], spec[o.request_id] = o.finish_reason, o.spec
    core.check_integrity()
    return out, reasons, spec


def test_a_worker_in_another_process_serves_through_plans_and_results(engines):
    tok = load_tokenizer("tiny-random")
    reqs = requests(tok)
    worker = ProcessWorker(CONFIG)
    try:
        remote_core = EngineCore(CONFIG, worker=worker)
        remote = serve(remote_core, reqs)
    finally:
        worker.close()
    local_core = engines.core(CONFIG)
    local = serve(local_core, reqs)
    assert worker.facts() == local_core.worker.facts()          # the one start-up message
    assert remote_core.model_info == local_core.model_info
    assert remote_core.engine_info == local_core.engine_info
    out, reasons, spec = remote
    assert remote == local
    assert len(out["greedy"]) == 20 and len(out["seeded"]) == 20
    assert spec["greedy"].num_accepted_tokens > 0               # speculation ran remotely
    assert spec["schema"].num_accepted_tokens > 0               # ... under the grammar too
    assert tok.decode(out["choice"][:-1]) in ("yes", "no") and reasons["choice"] == "stop"
    jsonschema.validate(json.loads(tok.decode(out["schema"][:-1])), SCHEMA)
    # each constrained request's compiled grammar crossed once, in the plan that first
    # scheduled it
    sent = [g.request_id for plan in worker.plans for g in plan.grammars]
    assert sorted(sent) == ["choice", "schema"]
