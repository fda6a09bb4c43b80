"""Chat tool calls at the OpenAI door: `tools` + `tool_choice` -> an output constraint, and the
model's output -> OpenAI `tool_calls`.

- `tool_choice` `"none"` (or no tools): plain text.
- a named function (`{"type": "function", "function": {"name": N}}`): the output is constrained
  to JSON valid against N's `parameters` schema (structured outputs, so it works for any model)
  and returned as one call of N with that JSON as its `arguments`.
- `"required"`: the output is constrained to a JSON array of at least one `{"name", "parameters"}`
  object, each naming one of the tools with parameters valid against its schema (vLLM's form); each
  element becomes a call.
- `"auto"` (the default with tools): the output is free; calls the model writes in the Hermes form
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what Qwen2.5, Hermes and SmolLM3's
  templates teach) are returned as calls and the rest as content. A model whose template teaches
  another form (or none, as SmolLM2's) answers in text: use "required" or a named function there.
The tools are also handed to the chat template (the model sees them where its template shows them).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from protos import model_pb2
from router.structured_formats import FormatError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(slots=True)
class ToolPlan:
    """What a chat request's tools ask of generation and of the reply."""

    mode: str  # "none" | "named" | "required" | "auto"
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters schema
    name: str = ""  # the named function
    constraint: model_pb2.StructuredOutput | None = None


def plan_tools(body: dict[str, Any]) -> ToolPlan:
    """Checks `tools` / `tool_choice` (the legacy `functions` / `function_call` too). Raises FormatError."""
    if body.get("functions") not in (None, []) or body.get("function_call") not in (None, "none"):
        raise FormatError("'functions' and 'function_call' are deprecated: use 'tools' and 'tool_choice'",
                          "functions" if body.get("functions") not in (None, []) else "function_call")
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none", tools)
    if not tools:
        raise FormatError("'tool_choice' needs 'tools'", "tool_choice")
    if choice == "auto":
        return ToolPlan("auto", tools)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in tools.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        return ToolPlan("required", tools, constraint=model_pb2.StructuredOutput(json_schema=json.dumps(schema)))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in tools:
            raise FormatError(f"'tool_choice' names {name!r}, which is not one of the tools", "tool_choice")
        return ToolPlan("named", tools, name, model_pb2.StructuredOutput(json_schema=json.dumps(tools[name])))
    raise FormatError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                      "'function': {'name': ...}}", "tool_choice")


def _tools(value: Any) -> dict[str, dict[str, Any]]:
    if value is None:
        return {}
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise FormatError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    tools: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)):
            raise FormatError(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", where)
        function = tool["function"]
        name = function.get("name")
        if not (isinstance(name, str) and _NAME.match(name)):
            raise FormatError(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'", where)
        if name in tools:
            raise FormatError(f"two tools are named {name!r}", where)
        params = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise FormatError(f"'{where}.function.parameters' must be a JSON schema object", where)
        tools[name] = params
    return tools


def template_tools(body: dict[str, Any]) -> str:
    """The request's tools as JSON for the chat template ("" without tools)."""
    tools = body.get("tools")
    return json.dumps(tools) if tools else ""


def call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def calls_from_output(plan: ToolPlan, text: str) -> tuple[list[dict[str, Any]], str | None]:
    """(tool calls, content) of a finished output. Named and required outputs were constrained, so
    they parse unless max_tokens cut them short: a named call is still the call, its arguments
    partial (as vLLM and OpenAI answer, finish_reason "length"; its stream sent them as they came);
    a cut "required" array is returned as content."""
    if plan.mode == "named":
        return [call(plan.name, text)], None
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return [], text
        return [call(item["name"], json.dumps(item["parameters"])) for item in items], None
    if plan.mode == "auto":
        calls = []
        for match in _HERMES.finditer(text):
            try:
                found = json.loads(match.group(1))
            except ValueError:
                continue
            if isinstance(found, dict) and found.get("name") in plan.tools:
                arguments = found.get("arguments", found.get("parameters", {}))
                calls.append(call(found["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
        if calls:
            content = _HERMES.sub("", text).strip()
            return calls, content or None
    return [], text
