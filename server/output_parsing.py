"""A chat turn's output text -> reasoning, content and tool calls, whole or streamed as OpenAI
deltas (docs/structured-output.md).

One mechanism for both: `OutputParser.parse(text, final)` answers for the text so far (a
reasoning parser splits off the thinking block, a tool parser of `server/tool_parsers.py` reads the
rest); the non-streamed response is the final answer, and `StreamDiffer` sends, after each new
piece of text, only what the answer added that cannot change any more. A call's arguments stream
as pieces of the JSON text `json.dumps` writes for the final arguments, so the joined pieces equal
the non-streamed call's `arguments` (an unfinished call sends its JSON up to its last value that
cannot grow, never a closing quote or bracket).

Reasoning parsers (`--reasoning-parser`, vLLM's names):
- `deepseek_r1`: the output starts inside a thinking block (DeepSeek-R1's template opens
  `<think>` in the prompt; a `<think>` the model writes itself is dropped); everything before
  `</think>` is reasoning, the rest content; no `</think>`: all of it is reasoning.
- `qwen3`: reasoning only when the output opens `<think>` or the prompt left one open (Qwen3's
  templates with thinking on); otherwise (e.g. `enable_thinking: false`, whose template closes
  an empty block in the prompt) all of it is content.
"""
from __future__ import annotations

import json
import logging

from specserve.server.tool_calls import ToolRequest, new_call_id
from specserve.server.tool_parsers import (DEFAULT_TOOL_PARSER, TOOL_PARSERS, HermesParser,
                                           Parsed, ParsedCall, ToolParser, held)

logger = logging.getLogger(__name__)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParser:
    name = ""

    def __init__(self, prompt: str = ""):
        self.prompt = prompt

    def thinking_at_start(self, text: str, final: bool) -> bool | None:
        """Whether the output starts inside a thinking block; None while it cannot be known."""
        return True

    def split(self, text: str, final: bool) -> tuple[str, str] | None:
        """-> (reasoning, the rest), or None while nothing can be said yet."""
        body = text.lstrip()
        thinking = self.thinking_at_start(body, final)
        if thinking is None:
            return None
        if not thinking:
            return "", text
        if not final and THINK_OPEN.startswith(body):         # maybe the model's own <think>
            return "", ""
        if body.startswith(THINK_OPEN):
            body = body[len(THINK_OPEN):]
        end = body.find(THINK_CLOSE)
        if end >= 0:
            return body[:end], body[end + len(THINK_CLOSE):].lstrip()
        if final:
            return body, ""
        return body[:len(body) - held(body, (THINK_CLOSE,))], ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def thinking_at_start(self, text: str, final: bool) -> bool | None:
        if self.prompt.rfind(THINK_OPEN) > self.prompt.rfind(THINK_CLOSE):
            return True                          # the template left a thinking block open
        if text.startswith(THINK_OPEN):
            return True
        if not final and THINK_OPEN.startswith(text):        # "", "<th": not known yet
            return None
        return False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def tool_parser_for(name: str | None, req: ToolRequest | None, tokenizer, prompt: str
                    ) -> ToolParser | None:
    """The parser for a request: none without tools; Hermes for `required` / a named function
    (the grammar writes Hermes calls); else `--tool-call-parser`, by default the checkpoint's
    `response_template` when its tokenizer has one, Hermes otherwise."""
    if req is None:
        return None
    if req.choice != "auto":
        return HermesParser(req)
    if name is None:
        name = ("transformers" if tokenizer is not None and tokenizer.response_template
                else DEFAULT_TOOL_PARSER)
    return TOOL_PARSERS[name](req, tokenizer, prompt)


class OutputParser:
    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None):
        self.tools, self.reasoning = tools, reasoning

    def fresh(self) -> OutputParser:
        return OutputParser(self.tools.fresh() if self.tools is not None else None,
                            self.reasoning)

    def parse(self, text: str, final: bool) -> Parsed:
        reasoning = ""
        if self.reasoning is not None:
            split = self.reasoning.split(text, final)
            if split is None:
                return Parsed()
            reasoning, text = split
        parsed = self.tools.parse(text, final) if self.tools is not None else Parsed(text)
        if reasoning.strip():
            parsed.reasoning = reasoning.strip()
        return parsed

    def message(self, text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
        """The whole output -> (content, reasoning, [(name, arguments JSON)])."""
        parsed = self.parse(text, final=True)
        calls = [(c.name, arguments_text(c, final=True)) for c in parsed.calls]
        content = parsed.content if parsed.content or not (calls or parsed.reasoning) else None
        return content, parsed.reasoning or None, calls


def arguments_text(call: ParsedCall, final: bool) -> str:
    """The call's arguments as JSON text; for an unfinished call only the part that cannot change
    (its serialization up to the last value that may still grow, no closing quote or bracket)."""
    if call.arguments is None:
        return "{}" if final else ""
    text = json.dumps(call.arguments, ensure_ascii=False)
    return text if call.done or final else text.rstrip('"}]')


class StreamDiffer:
    """Successive answers of an OutputParser -> the delta each adds."""

    def __init__(self, parser: OutputParser):
        self.parser = parser.fresh()
        self.text = ""
        self.sent = {"reasoning": "", "content": ""}     # what each field has streamed so far
        self.sent_args: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.sent_args)

    def feed(self, text: str, final: bool) -> dict:
        """New output text -> the delta fields to send (`reasoning` and `reasoning_content`,
        `content`, `tool_calls`); empty when nothing can be sent yet."""
        self.text += text
        parsed = self.parser.parse(self.text, final)
        delta: dict = {}
        reasoning = self._extend("reasoning", parsed.reasoning)
        if reasoning:                     # current vLLM's name, and the older one clients read
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        content = self._extend("content", parsed.content)
        if content:
            delta["content"] = content
        calls = []
        for i, call in enumerate(parsed.calls):
            item: dict = {"index": i}
            if i == len(self.sent_args):
                item.update(id=new_call_id(), type="function")
                item["function"] = {"name": call.name}
                self.sent_args.append("")
            args = arguments_text(call, final)
            sent = self.sent_args[i]
            if args.startswith(sent) and len(args) > len(sent):
                item.setdefault("function", {})["arguments"] = args[len(sent):]
                self.sent_args[i] = args
            elif not args.startswith(sent):
                logger.warning("tool call %d: arguments %r do not extend what was sent (%r)", i,
                               args, sent)
            if len(item) > 1:
                if "id" in item:
                    item["function"].setdefault("arguments", "")
                calls.append(item)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _extend(self, field: str, value: str) -> str:
        sent = self.sent[field]
        if value.startswith(sent):
            self.sent[field] = value
            return value[len(sent):]
        logger.warning("streamed %s %r does not extend what was sent (%r)", field, value, sent)
        return ""
