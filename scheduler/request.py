"""Request state inside the engine: tokens, progress counters and status. Pure Python."""
from __future__ import annotations

import enum

from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3     # finish_reason "stop"
    FINISHED_LENGTH = 4      # finish_reason "length"
    FINISHED_ABORTED = 5     # finish_reason "abort"
    FINISHED_ERROR = 6       # finish_reason "error"

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort", 6: "error"}.get(int(self))


class Request:
    def __init__(self, req: EngineRequest):
        self.request_id = req.request_id
        self.params: SamplingParams = req.sampling_params
        self.arrival_time = req.arrival_time
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(req.prompt_token_ids)   # prompt + output
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0                       # tokens whose KV is in the cache
        # prefix-cache hit at first schedule (-1: not yet)
        self.num_cached_tokens = -1
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        # a draft slot was planned since the last (re)start: the drafter has built this
        # request's state (lossy_kv's compressed cache), so drafting costs no start-up any more
        self.drafted = False
        self.ready_drafts: int | None = None            # drafts the worker proposed for the next
                                                        # step (`StepResult.draft_lens`)
        self.prompt_logprobs: list = []                    # gathered over prefill chunks
        # speculative decoding counters (vLLM's definitions)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def want_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> bool:
        """After appending a token: EOS, stop token ids, max_tokens, end of context."""
        token = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if not self.params.ignore_eos and token in eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in self.params.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, token
                return True
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
