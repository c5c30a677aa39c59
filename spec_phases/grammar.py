"""Structured output, the worker's side: one grammar matcher per constrained request, masks for
every row it samples.

    compiled grammar (text, in the plan once: scheduler/structured_output.py) --> pristine
    LLMatcher, kept per grammar text --> per request: a deep copy of it, advanced over the
    request's accepted tokens only

The engine compiles and validates each constraint; the worker builds a matcher from that text (a
millisecond) with the model's tokenizer, loaded on the first grammar. Requests of one grammar copy
one pristine matcher: the copies share the automaton llguidance grows lazily as masks are computed,
so later requests mask faster than from a matcher of their own. Drafts are made inside the
worker's step, so the masks of their rows are made here too.

A speculative step over a constrained request, given its drafts d:
1. **truncate**: d is cut before the first token the grammar forbids after d[:i] (that draft could
   never be accepted: its row's mask excludes it). The cut tokens still count as drafted, and as
   rejected, so FASER's acceptance estimate sees them (`SampledTokens.num_masked`).
2. **masks**: row i's mask is the grammar state after d[:i]: the matcher advances over the kept
   drafts, one mask per row, then rolls back all of them.
3. **accept** (verify.py): each row draws from its masked distribution; drafts are kept up to the
   first mismatch, then that row's token.
4. **advance**: the matcher consumes the accepted drafts and the one new token: exactly the tokens
   plain constrained decoding would have sampled, so its state (and the text) does not depend on
   speculation.
Once the grammar is complete only EOS is allowed, so the request stops there.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
MAX_PRISTINE = 256                      # pristine matchers kept (least recently used dropped)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's int32 bitmask [rows, words] (bit b of word w: token 32 w + b) -> bool [rows,
    vocab], True where the token is allowed."""
    import torch

    raw = bitmask.contiguous().numpy().view(np.uint8)    # little-endian hosts: bytes in order
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).bool()


@dataclass
class Constrained:
    """What the verify phase needs for one constrained request this step."""
    masks: torch.Tensor          # bool [kept drafts + 1, vocab]: row i after drafts[:i]
    num_masked: int              # drafts cut because the grammar forbids them


class GrammarMatchers:
    """Each live constrained request's matcher. Requests' grammar state is per-request
    device-side state like a drafting cache: built from the plan's `grammars`, dropped with its
    finished ids (kept across preemption: the output tokens it matched are kept)."""

    def __init__(self, tokenizer_loader: Callable[[], object], vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        """tokenizer_loader: the model's HF tokenizer (called once, on the first grammar)."""
        self._load_tokenizer = tokenizer_loader
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        self._tokenizer = None                      # llguidance's, built on the first grammar
        self._pristine: OrderedDict[str, object] = OrderedDict()   # grammar text -> matcher
        self.matchers: dict[str, object] = {}       # None: its grammar failed (EOS only)
        self.mask_seconds = 0.0                     # total time spent cutting drafts and masking

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._load_tokenizer(), n_vocab=self.vocab_size,
                eos_token=list(self.eos_token_ids))
        return self._tokenizer

    def start(self, request_id: str, grammar: str) -> None:
        """A constrained request's first plan: its matcher, from the compiled grammar."""
        import llguidance

        pristine = self._pristine.get(grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
            self._pristine[grammar] = pristine
            while len(self._pristine) > MAX_PRISTINE:
                self._pristine.popitem(last=False)
        self._pristine.move_to_end(grammar)
        if pristine.is_error():      # the engine validated it: a limit only the tokens reach
            logger.error("request %s: grammar error: %s", request_id, pristine.get_error())
            self.matchers[request_id] = None
        else:
            self.matchers[request_id] = pristine.deep_copy()

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)

    def constrain(self, request_id: str, drafts: list[int]) -> tuple[list[int], Constrained]:
        """Cut the drafts at the first token the grammar forbids; one mask per verify row."""
        import llguidance.numpy as llnp     # not llguidance.torch: it imports torch.compile (2 s)
        import torch

        if request_id not in self.matchers:
            raise RuntimeError(f"request {request_id}: constrained, but no plan carried its "
                               f"grammar")
        matcher = self.matchers[request_id]
        start = time.perf_counter()
        if matcher is None or matcher.is_error():
            return [], Constrained(self._eos_only(1), len(drafts))
        kept = drafts[:matcher.validate_tokens(list(drafts))] if drafts else []
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(kept) + 1, words, dtype=torch.int32)
        rows = bitmask.numpy()                                          # the same memory
        for i in range(len(kept) + 1):
            llnp.fill_next_token_bitmask(matcher, rows, i)
            if i < len(kept) and not matcher.consume_token(kept[i]):
                raise RuntimeError(f"request {request_id}: the grammar refused a draft it had "
                                   f"validated")
        if kept:
            matcher.rollback(len(kept))
        if matcher.is_error():                  # e.g. a step over the parser's limits: stop
            logger.error("request %s: grammar error: %s", request_id, matcher.get_error())
            self.mask_seconds += time.perf_counter() - start
            return [], Constrained(self._eos_only(1), len(drafts))
        masks = unpack_bitmask(bitmask, self.vocab_size)
        self.mask_seconds += time.perf_counter() - start
        return kept, Constrained(masks, len(drafts) - len(kept))

    def advance(self, request_id: str, tokens: list[int]) -> None:
        """The accepted drafts and the new token of this step."""
        matcher = self.matchers.get(request_id)
        if matcher is None or matcher.is_error():
            return
        eos = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), len(tokens))
        tokens = tokens[:eos]                   # EOS ends the request (and the grammar)
        if tokens and not matcher.consume_tokens(tokens):
            logger.error("request %s: the grammar refused accepted tokens: %s", request_id,
                         matcher.get_error())

    def _eos_only(self, rows: int) -> torch.Tensor:
        import torch

        mask = torch.zeros(rows, self.vocab_size, dtype=torch.bool)
        mask[:, list(self.eos_token_ids)] = True
        return mask
