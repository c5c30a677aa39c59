"""Offline batch generation: `LLM(model).generate(prompts, params)`, like vLLM's offline API."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from tqdm.auto import tqdm

from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest, TokenLogprob
from specserve.spec_phases.sampling_params import SamplingParams


@dataclass
class GenerateOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob]


class LLM:
    def __init__(self, model: str | None = None, tokenizer=None, **engine_kwargs):
        names = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        self.engine = EngineCore(EngineConfig(model=model, **engine_kwargs))
        if tokenizer is None:
            from specserve.server.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(model)
        self.tokenizer = tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerateOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(token_lists)
        order, results = [], {}
        for ids, p in zip(token_lists, per_prompt):
            req = EngineRequest(f"offline-{next(self._ids)}", ids, p)
            self.engine.add_request(req)
            order.append(req.request_id)
            results[req.request_id] = GenerateOutput(ids, [], "", None, [])
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step().outputs:
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.logprobs.extend(out.new_logprobs or [])
                if out.finished:
                    res.finish_reason = out.finish_reason
                    bar.update(1)
        bar.close()
        for res in results.values():
            res.text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        return [results[i] for i in order]
