"""Tool calling on chat: the request's `tools` / `tool_choice` / `parallel_tool_calls`, the prompt
they add, the grammar that forces a call, and the parser that turns output text into OpenAI-shaped
`tool_calls` (docs/structured-output.md); the output parsers are in `server/tool_parsers.py`.

The call format is Hermes-style, the one Qwen2.5, Hermes and SmolLM3 templates use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that takes `tools` renders them itself; for one that does not, the tools and this
format are described in the system message (`TOOL_SYSTEM_PROMPT`). With `tool_choice` "required"
or a named function the output is constrained by a grammar to one call (or, with
`parallel_tool_calls`, one or more) whose arguments match the function's parameter schema, so they
always parse and validate. Other call formats (`--tool-call-parser`) are read by
`server/tool_parsers.py`; streamed and non-streamed responses come from the same parser.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.spec_phases.sampling_params import TOOL_CALL_CLOSE as CALL_CLOSE
from specserve.spec_phases.sampling_params import TOOL_CALL_OPEN as CALL_OPEN
from specserve.spec_phases.sampling_params import Constraint

TOOL_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>\n{tools}\n</tools>\nFor each function call return a JSON object with the "
    "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


class ToolError(ValueError):
    """A 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def spec(self) -> dict:
        """The OpenAI function object, as templates and the system prompt show it."""
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return {"type": "function", "function": out}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str                      # "auto" | "required" | "named"
    named: str | None = None         # the function tool_choice names
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}


def parse_tools(tools: list[dict] | None, tool_choice: str | dict | None,
                parallel_tool_calls: bool | None) -> ToolRequest | None:
    """Validate the request's tool fields; None when no tool may be called (no tools, or
    tool_choice "none")."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice needs `tools`; none were given.")
        return None
    parsed, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools.{i}", "each tool must be {\"type\": \"function\", "
                                          "\"function\": {...}}.")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"tools.{i}.function.name", "a function needs a non-empty name.")
        if name in seen:
            raise ToolError(f"tools.{i}.function.name", f"function {name!r} is defined twice.")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"tools.{i}.function.parameters",
                            "parameters must be a JSON schema object.")
        description = fn.get("description")
        parsed.append(Tool(name, description if isinstance(description, str) else None, params))
    if tool_choice is None or tool_choice == "auto":
        choice, named = "auto", None
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        choice, named = "required", None
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice", "a named tool_choice is {\"type\": \"function\", "
                                           "\"function\": {\"name\": ...}}.")
        if name not in seen:
            raise ToolError("tool_choice", f"tool_choice names function {name!r}, which is not "
                                           f"in `tools`.")
        choice, named = "named", name
    else:
        raise ToolError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a "
                                       f"named function, got {tool_choice!r}.")
    return ToolRequest(tuple(parsed), choice, named,
                       parallel=parallel_tool_calls is not False and choice != "named")


def call_grammar(req: ToolRequest) -> Constraint | None:
    """For "required" and a named function: the "tool_calls" constraint
    (scheduler/structured_output.py builds its grammar), which admits only well-formed calls with valid arguments."""
    if req.choice == "auto":
        return None
    tools = [{"name": t.name, "parameters": t.parameters} for t in req.tools
             if req.named is None or t.name == req.named]
    return Constraint("tool_calls", json.dumps({"tools": tools, "parallel": req.parallel},
                                               ensure_ascii=False), param="tools")


# -- the prompt ------------------------------------------------------------------------------------
def system_prompt(req: ToolRequest) -> str:
    return TOOL_SYSTEM_PROMPT.format(
        tools="\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in req.tools))


def with_tool_prompt(conversation: list[dict], req: ToolRequest) -> list[dict]:
    """For a template without a tool section: the tools go into the system message (appended to
    the caller's own, or as a new first message)."""
    text = system_prompt(req)
    if conversation and conversation[0]["role"] == "system":
        first = dict(conversation[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first] + conversation[1:]
    return [{"role": "system", "content": text}] + conversation


def history_message(message: dict, template_has_tools: bool) -> dict:
    """An assistant message with `tool_calls` or a `tool` message, as the template sees it: as
    given (arguments parsed to objects) when the template has a tool section, else as Hermes text
    (calls in <tool_call> tags, results in <tool_response> tags)."""
    calls = message.get("tool_calls") or []
    if template_has_tools:
        out = dict(message)
        if calls:
            out["tool_calls"] = [{**c, "function": {**c["function"], "arguments":
                                                    _arguments_object(c["function"])}}
                                 for c in calls]
        return out
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message['content']}\n"
                                           f"</tool_response>"}
    if calls:
        text = "\n".join(
            f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                           "arguments": _arguments_object(c["function"])},
                                          ensure_ascii=False) + f"\n{CALL_CLOSE}"
            for c in calls)
        content = message.get("content") or ""
        return {"role": message["role"], "content": f"{content}\n{text}" if content else text}
    return message


def _arguments_object(fn: dict) -> Any:
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


# -- the output ----------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_objects(calls: list[tuple[str, str]], ids: list[str]) -> list[dict]:
    """message.tool_calls as OpenAI shapes them."""
    return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            for (name, args), call_id in zip(calls, ids)]
