"""Tool-call parsers: model output text -> content and calls, one parser per call format, chosen
by `--tool-call-parser NAME` (vLLM's names) from `TOOL_PARSERS`.

Every parser answers one question, `parse(text, final)`: the content and the calls in the text so
far. `final=False` is the streamed view of a prefix: it holds back whatever the rest of the text
could still change (a partial marker, an unfinished call's content), so that each later answer
extends the earlier one; `server/output_parsing.py` turns successive answers into OpenAI deltas.
A call's `arguments` is an object, possibly partial while `done` is False (the differ sends only
the part of its JSON text that cannot change); `None` while nothing of it is known.

| name | format |
|---|---|
| `hermes` | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Hermes, SmolLM3) |
| `llama3_json` | `<|python_tag|>`? `{"name": ..., "parameters": {...}}`, `;`-separated (Llama 3) |
| `mistral` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name[ARGS]{...}` |
| `qwen3_xml` | `<tool_call><function=F><parameter=K>V</parameter>...</function></tool_call>` |
| `qwen3_coder` | the same (vLLM's name for it) |
| `pythonic` | `[get_weather(city="Paris"), add(a=1, b=2)]` (Llama 3.2/4 pythonic) |
| `transformers` | the checkpoint's own `response_template` through transformers' `ResponseParser` |

A call naming a function that is not in the request's `tools` is not a call: its text stays
content. Whitespace next to a call, and at the end, is dropped from the content.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from specserve.server.tool_calls import CALL_CLOSE, CALL_OPEN, ToolRequest

# partial values kept: strings, objects, arrays (a number or literal is kept only once complete:
# "12" may still become "123", "1e" is no number yet)
PARTIAL = Allow.STR | Allow.OBJ | Allow.ARR
NAME_RE = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


@dataclass
class ParsedCall:
    name: str
    arguments: Any = None            # dict; partial while not done; None: nothing known yet
    done: bool = False


@dataclass
class Parsed:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    reasoning: str = ""


def held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the markers."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def join_content(pieces: list) -> str:
    """Content pieces and calls in order -> the content: whitespace next to a call and at the end
    dropped."""
    out = []
    for i, piece in enumerate(pieces):
        if not isinstance(piece, str):
            continue
        if i > 0 and not isinstance(pieces[i - 1], str):
            piece = piece.lstrip()
        if i + 1 < len(pieces) and not isinstance(pieces[i + 1], str):
            piece = piece.rstrip()
        out.append(piece)
    return "".join(out).rstrip()


def lenient_json(text: str) -> Any:
    """A complete JSON value (trailing text ignored), else the partial value of the longest prefix
    that reads as one (what a stream saw before the text went wrong), else None."""
    text = text.strip()
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        pass
    for end in range(len(text), 0, -1):
        try:
            return partial_loads(text[:end], PARTIAL)
        except Exception:               # the library raises its own error types
            continue
    return None


def partial_json(text: str) -> Any:
    """A JSON value still being written (a complete one with text after it: that value)."""
    text = text.strip()
    if not text:
        return None
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        pass
    try:
        return partial_loads(text, PARTIAL)
    except Exception:                   # the library raises its own error types
        return None


def complete_name(text: str) -> str | None:
    """The value of the first complete `"name": "..."` in text."""
    m = NAME_RE.search(text)
    if m is None:
        return None
    try:
        return json.loads(m.group(1))
    except ValueError:
        return None


def arguments_of(obj: Any, done: bool) -> Any:
    """`arguments` (or `parameters`) of a call object: a dict, or None while unknown."""
    if not isinstance(obj, dict):
        return {} if done else None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):                 # arguments given as a JSON string
        if not done:
            return None
        try:
            args = json.loads(args)
        except ValueError:
            return {}
    if args is None:
        return {} if done else None
    return args if isinstance(args, dict) else ({} if done else None)


class ToolParser:
    """Base: `parse(text, final)`; `skip_special_tokens` False where the format's markers are
    special tokens a detokenizer would drop (Mistral's `[TOOL_CALLS]`)."""
    name: ClassVar[str] = ""
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self, req: ToolRequest, tokenizer=None, prompt: str = ""):
        self.req = req

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def fresh(self) -> ToolParser:
        """A parser for one stream (the parsers are stateless; one that caches returns a copy)."""
        return self

    def finish(self, pieces: list, calls: list[ParsedCall]) -> Parsed:
        if not self.req.parallel:
            calls = calls[:1]
            keep = calls[0] if calls else None
            pieces = [p for p in pieces if isinstance(p, str) or p is keep]
        return Parsed(join_content(pieces), calls)

    def json_call(self, text: str, done: bool) -> ParsedCall | None:
        """A JSON call object's text -> the call, or None when it names no known function."""
        name = complete_name(text)
        if name is None or name not in self.req.names:
            return None
        obj = lenient_json(text) if done else partial_json(text)
        return ParsedCall(name, arguments_of(obj, done), done)


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        pieces: list = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(CALL_OPEN, pos)
            if start < 0:
                rest = text[pos:]
                pieces.append(rest if final else rest[:len(rest) - held(rest, (CALL_OPEN,))])
                break
            pieces.append(text[pos:start])
            end = text.find(CALL_CLOSE, start)
            inner = text[start + len(CALL_OPEN):end if end >= 0 else len(text)]
            if end < 0 and not final:
                inner = inner[:len(inner) - held(inner, (CALL_CLOSE,))]
            call = self.json_call(inner, done=end >= 0 or final)
            if call is not None:
                calls.append(call)
                pieces.append(call)
            elif end >= 0 or final:                 # not a call: its text is content
                pieces.append(text[start:end + len(CALL_CLOSE) if end >= 0 else len(text)])
            if end < 0:
                break
            pos = end + len(CALL_CLOSE)
        return self.finish(pieces, calls)


def json_sequence(text: str, pos: int, separators: str, stop: str = ""
                  ) -> tuple[list[tuple[int, str, bool]], int, bool]:
    """JSON objects from text[pos:], separated by any of `separators` (and whitespace), up to
    `stop` -> ([(start, object text, complete)], the position after the last complete one (after
    `stop` when it came), whether `stop` came)."""
    out, decoder = [], json.JSONDecoder()
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text):
            return out, pos, False
        if stop and text.startswith(stop, pos):
            return out, pos + len(stop), True
        if text[pos] != "{":
            return out, pos, False
        try:
            _, end = decoder.raw_decode(text, pos)
        except ValueError:
            out.append((pos, text[pos:], False))
            return out, len(text), False
        out.append((pos, text[pos:end], True))
        pos = end


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if not final and (not body or self.TAG.startswith(body)):
            return Parsed()
        start = len(self.TAG) if body.startswith(self.TAG) else 0
        if not body[start:].lstrip().startswith("{"):
            if not final and start and not body[start:].strip():
                return Parsed()
            return Parsed(text.rstrip())                # plain text
        objects, pos, _ = json_sequence(body, start, ";")
        calls: list[ParsedCall] = []
        for obj_start, obj_text, complete in objects:
            call = self.json_call(obj_text, done=complete or final)
            if call is None:
                pos = obj_start
                break
            calls.append(call)
        if not calls:
            return Parsed(text.rstrip() if final else "")
        return self.finish([*calls, body[pos:] if final else ""], calls)


class MistralParser(ToolParser):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    skip_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.TAG)
        if start < 0:
            return Parsed(text.rstrip() if final
                          else text[:len(text) - held(text, (self.TAG,))].rstrip())
        pieces: list = [text[:start]]
        calls: list[ParsedCall] = []
        body = text[start + len(self.TAG):]
        if body.lstrip().startswith("["):               # a JSON array of calls
            pos = body.find("[") + 1
            objects, pos, closed = json_sequence(body, pos, ",", stop="]")
            for _, obj_text, complete in objects:
                call = self.json_call(obj_text, done=complete or final)
                if call is None:
                    break
                calls.append(call)
            pieces += calls
            if final and len(calls) == len(objects) and closed:
                pieces.append(body[pos:])
        else:                                           # name[ARGS]{...}, each after the tag
            for part in body.split(self.TAG):
                name, sep, args = part.partition(self.ARGS)
                name = name.strip()
                if not sep or name not in self.req.names:
                    if final and part.strip():
                        pieces.append(part)
                    break
                objects, pos, _ = json_sequence(args, 0, "")
                done = final or bool(objects and objects[0][2])
                obj = lenient_json(objects[0][1]) if objects and done else \
                    partial_json(objects[0][1]) if objects else None
                call = ParsedCall(name, obj if isinstance(obj, dict) else
                                  ({} if done else None), done)
                calls.append(call)
                pieces.append(call)
        return self.finish(pieces, calls)


class Qwen3XmlParser(ToolParser):
    """Qwen3-Coder's XML calls; values converted by the parameter's schema type, as vLLM's
    qwen3_coder parser does (strings kept, integer/number/boolean/object/array converted)."""
    name = "qwen3_xml"
    OPENS = (CALL_OPEN, "<function=")
    FUNCTION = re.compile(r"<function=([^>\n]+)>")
    PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|"
                       r"(?=</function>)|\Z)", re.S)

    def parse(self, text: str, final: bool) -> Parsed:
        pieces: list = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            starts = [(i, tag) for tag in self.OPENS if (i := text.find(tag, pos)) >= 0]
            if not starts:
                rest = text[pos:]
                pieces.append(rest if final else rest[:len(rest) - held(rest, self.OPENS)])
                break
            start, tag = min(starts)
            pieces.append(text[pos:start])
            close = CALL_CLOSE if tag == CALL_OPEN else "</function>"
            end = text.find(close, start)
            block = text[start:end + len(close) if end >= 0 else len(text)]
            call = self._call(block, done=end >= 0 or final)
            if call is not None:
                calls.append(call)
                pieces.append(call)
            elif end >= 0 or final:
                pieces.append(block)
            if end < 0:
                break
            pos = end + len(close)
        return self.finish(pieces, calls)

    def _call(self, block: str, done: bool) -> ParsedCall | None:
        m = self.FUNCTION.search(block)
        if m is None or m.group(1).strip() not in self.req.names:
            return None
        name = m.group(1).strip()
        body = block[m.end():]
        cut = body.find("</function>")
        if cut >= 0:
            body, done = body[:cut], True
        schema = next(t.parameters for t in self.req.tools if t.name == name)
        args = {}
        for p in self.PARAM.finditer(body):
            closed = p.group(0).endswith("</parameter>") or p.end() < len(body)
            if not (closed or done):
                break                                   # its value may still grow
            key = p.group(1).strip()
            args[key] = convert_value(p.group(2), (schema.get("properties") or {}).get(key))
        return ParsedCall(name, args, done)


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says (vLLM's qwen3_coder conversion)."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    types = schema.get("type", "string") if isinstance(schema, dict) else "string"
    types = [types] if isinstance(types, str) else list(types)
    if value.lower() == "null" and "string" not in types:
        return None
    for kind in types:
        try:
            if kind in ("integer", "int"):
                return int(value.strip())
            if kind in ("number", "float"):
                number = float(value.strip())
                return int(number) if number.is_integer() and "." not in value else number
            if kind in ("boolean", "bool"):
                if value.strip().lower() in ("true", "false"):
                    return value.strip().lower() == "true"
            if kind in ("object", "array"):
                return json.loads(value)
        except (ValueError, OverflowError):
            continue
    return value


class PythonicParser(ToolParser):
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    CALL_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.START):
            body = body[len(self.START):].lstrip()
        elif not final and (not body or self.START.startswith(body)):
            return Parsed()
        if not body.startswith("["):
            return Parsed(text.rstrip())
        elements, end = top_level_elements(body)
        calls: list[ParsedCall] = []
        for element, complete in elements:
            m = self.CALL_NAME.match(element)
            if m is None or m.group(1) not in self.req.names:
                break
            done = complete or final
            calls.append(ParsedCall(m.group(1), python_arguments(element) if done else None,
                                    done))
        if not calls:
            return Parsed(text.rstrip() if final else "")
        rest = ""
        if final and end is not None and len(calls) == len(elements):
            rest = body[end:].replace(self.END, "", 1)
        return self.finish([*calls, rest], calls)


def top_level_elements(body: str) -> tuple[list[tuple[str, bool]], int | None]:
    """`[a(...), b(...)` -> the elements at depth 1 with whether each is complete, and the
    position after the closing `]` (None while open). Strings and brackets are skipped over."""
    elements, depth, quote, start, i = [], 0, "", 1, 0
    while i < len(body):
        ch = body[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:                                  # the list closed
                if body[start:i].strip():
                    elements.append((body[start:i].strip(), True))
                return elements, i + 1
            if depth == 1 and ch == ")":
                elements.append((body[start:i + 1].strip(), True))
                start = i + 1
        elif ch == "," and depth == 1:
            start = i + 1
        i += 1
    if body[start:].strip() and depth > 1:
        elements.append((body[start:].strip(), False))
    return elements, None


def python_arguments(element: str) -> dict:
    """`f(a=1, b="x")` -> {"a": 1, "b": "x"} (literals only; anything else -> {})."""
    try:
        node = ast.parse(element, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return {}
        return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (SyntaxError, ValueError):
        return {}


class TransformersParser(ToolParser):
    """The checkpoint's `response_template` (tokenizer_config.json) through transformers'
    `ResponseParser`: content from the `content` region's chunks, reasoning from
    `reasoning_content`/`thinking`, and each `tool_calls` region once it closes."""
    name = "transformers"
    REASONING = ("reasoning_content", "thinking", "reasoning")

    def __init__(self, req: ToolRequest | None, tokenizer=None, prompt: str = ""):
        self.req, self.tokenizer, self.prompt = req, tokenizer, prompt
        self.template = tokenizer.response_template if tokenizer is not None else None
        # a stream's parser, fed only the new text, and what its events said so far (re-reading
        # the whole text at every delta would cost time quadratic in the answer's length)
        self._stream, self._fed = None, ""
        self._pieces: list = []
        self._reasoning = ""

    def fresh(self) -> TransformersParser:
        return TransformersParser(self.req, self.tokenizer, self.prompt)

    def parse(self, text: str, final: bool) -> Parsed:
        from transformers.utils.chat_parsing import ResponseParser

        if self._stream is None or not text.startswith(self._fed):
            tools = [t.spec() for t in self.req.tools] if self.req is not None else None
            self._stream = ResponseParser(self.template, prefix=self.prompt, tools=tools)
            self._fed, self._pieces, self._reasoning = "", [], ""
        self._take(self._stream.feed(text[len(self._fed):]))
        self._fed = text
        pieces, reasoning = self._pieces, self._reasoning
        if final:
            self._take(self._stream.finalize()[1])
            pieces, reasoning = self._pieces, self._reasoning
            self._stream = None
        calls = [p for p in pieces if isinstance(p, ParsedCall)]
        parsed = self.finish(pieces, calls) if self.req is not None else \
            Parsed(join_content(pieces))
        parsed.content = parsed.content.lstrip()         # the region's text, stripped
        parsed.reasoning = reasoning.strip()
        return parsed

    def _take(self, events: list[dict]) -> None:
        for event in events:
            field = event["field"]
            if event["type"] == "region_chunk" and field == "content":
                if self._pieces and isinstance(self._pieces[-1], str):
                    self._pieces[-1] += event["text"]
                else:
                    self._pieces.append(event["text"])
            elif event["type"] == "region_chunk" and field in self.REASONING:
                self._reasoning += event["text"]
            elif event["type"] == "region_close" and field == "tool_calls":
                values = event["value"] if isinstance(event["value"], list) else [event["value"]]
                self._pieces += [c for c in map(self._call, values) if c is not None]

    def _call(self, value: Any) -> ParsedCall | None:
        fn = value.get("function", value) if isinstance(value, dict) else None
        if not isinstance(fn, dict) or self.req is None or fn.get("name") not in self.req.names:
            return None
        return ParsedCall(fn["name"], arguments_of(fn, done=True), True)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, Qwen3XmlParser,
                              PythonicParser, TransformersParser)}
TOOL_PARSERS["qwen3_coder"] = Qwen3XmlParser          # vLLM's name for the same format
DEFAULT_TOOL_PARSER = "hermes"


def tool_parser_names() -> list[str]:
    return sorted(TOOL_PARSERS)
