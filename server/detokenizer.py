"""Incremental detokenization and stop strings: the only place tokens become text.

- `IncrementalDetokenizer.step(ids)` returns only whole characters: a token that ends inside a UTF-8
  sequence yields nothing until the sequence is complete (tokenizers' `DecodeStream` does the byte
  bookkeeping; slow tokenizers fall back to diffing full decodes).
- `StopStringMatcher.feed(text)` finds stop strings across token boundaries and holds back the last
  `len(longest stop) - 1` characters, so a partial stop string is never sent (openai-api.md §3).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

REPLACEMENT_CHAR = "\ufffd"


def backend_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, or None (a slow one)."""
    from transformers import PreTrainedTokenizerFast

    return tokenizer.backend_tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.backend = backend_tokenizer(tokenizer)
        self.stream = None
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream
            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []          # fallback path: everything seen
        self.emitted_len = 0                    # fallback path: characters already returned

    def step(self, token_ids: list[int]) -> str:
        """Text completed by these new tokens (possibly empty)."""
        if self.stream is not None:
            pieces = []
            for tok in token_ids:
                piece = self.stream.step(self.backend, int(tok))
                if piece:
                    pieces.append(piece)
            return "".join(pieces)
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith(REPLACEMENT_CHAR):      # an incomplete UTF-8 sequence: wait for more bytes
            return ""
        new, self.emitted_len = text[self.emitted_len:], len(text)
        return new


@dataclass
class StopMatch:
    text: str                 # text that may be sent now
    stop: str | None = None   # the stop string that fired, if any


class StopStringMatcher:
    """Matches stop strings on the generated text. Feed deltas; `flush()` at the end of the
    stream."""

    def __init__(self, stops: list[str], include_in_output: bool = False):
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""                        # received but not yet released
        self.stopped: str | None = None

    def feed(self, text: str) -> StopMatch:
        if self.stopped is not None:
            return StopMatch("")
        if not self.stops:
            return StopMatch(text)
        buffer = self.pending + text
        first: tuple[int, str] | None = None
        # earliest match wins; ties go to the longest string
        for stop in self.stops:
            at = buffer.find(stop)
            earlier = first is None or at < first[0] or (at == first[0]
                                                          and len(stop) > len(first[1]))
            if at >= 0 and earlier:
                first = (at, stop)
        if first is not None:
            at, stop = first
            self.stopped, self.pending = stop, ""
            end = at + len(stop) if self.include_in_output else at
            return StopMatch(buffer[:end], stop)
        cut = max(len(buffer) - self.holdback, 0)
        self.pending = buffer[cut:]
        return StopMatch(buffer[:cut])

    def flush(self) -> str:
        """Release what was held back once no more text will come."""
        rest, self.pending = self.pending, ""
        return rest if self.stopped is None else ""


def make_token_text(tokenizer):
    """A cached `token id -> text` for logprobs (one token decoded alone, specials kept)."""

    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([int(token_id)], skip_special_tokens=False)

    return token_text
