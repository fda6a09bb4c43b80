"""Chat tools at the door (router/tool_calls.py): plans, constraints, and outputs -> tool_calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from router.structured_formats import FormatError
from router.tool_calls import calls_from_output, plan_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "now", "parameters": TIME}}]


def test_no_tools_or_none_is_plain_text() -> None:
    assert plan_tools({}).mode == "none"
    plan = plan_tools({"tools": TOOLS, "tool_choice": "none"})
    assert plan.mode == "none" and plan.constraint is None
    assert plan_tools({"tools": TOOLS}).mode == "auto"


def test_named_function_constrains_to_its_parameters() -> None:
    plan = plan_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert plan.mode == "named" and json.loads(plan.constraint.json_schema) == TIME
    calls, content = calls_from_output(plan, '{"zone": "UTC"}')
    assert content is None and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    calls, content = calls_from_output(plan, '{"zone": "U')  # cut short: still the call, arguments partial
    assert content is None and [c["function"] for c in calls] == [{"name": plan.name, "arguments": '{"zone": "U'}]


def test_required_is_an_array_of_named_calls() -> None:
    plan = plan_tools({"tools": TOOLS, "tool_choice": "required"})
    schema = json.loads(plan.constraint.json_schema)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {"zone": "CET"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_time", "parameters": {"city": "x"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls, content = calls_from_output(plan, json.dumps(good))
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]


def test_auto_parses_hermes_calls() -> None:
    plan = plan_tools({"tools": TOOLS, "tool_choice": "auto"})
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    calls, content = calls_from_output(plan, text)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert calls_from_output(plan, "It is sunny.") == ([], "It is sunny.")
    assert calls_from_output(plan, '<tool_call>{"name": "other"}</tool_call>')[0] == []  # not one of the tools


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0]"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tools_are_a_400_naming_the_field(body, param) -> None:
    with pytest.raises(FormatError) as caught:
        plan_tools(body)
    assert caught.value.param == param
