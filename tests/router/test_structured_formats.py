"""The door's output-format fields -> StructuredOutput (router/structured_formats.py)."""

from __future__ import annotations

import json

import pytest

from protos import model_pb2
from router.structured_formats import FormatError, structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("body", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, model_pb2.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     model_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, model_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "array"}'}}, model_pb2.StructuredOutput(json_schema='{"type": "array"}')),
    ({"structured_outputs": {"regex": "[0-9]+"}}, model_pb2.StructuredOutput(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}},
     model_pb2.StructuredOutput(choice=model_pb2.Choices(choices=["a", "b"]))),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, model_pb2.StructuredOutput(grammar='root ::= "x"')),
    ({"structured_outputs": {"json_object": True}}, model_pb2.StructuredOutput(json_object=True)),
    ({"guided_json": SCHEMA}, model_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, model_pb2.StructuredOutput(regex="a+")),
    ({"guided_choice": ["x"]}, model_pb2.StructuredOutput(choice=model_pb2.Choices(choices=["x"]))),
    ({"guided_grammar": "start: /a+/"}, model_pb2.StructuredOutput(grammar="start: /a+/")),
])
def test_each_form_maps(body, expected) -> None:
    assert structured_output(body) == expected


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": []}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": 3}, "guided_json"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
])
def test_bad_forms_are_a_400_naming_the_field(body, param) -> None:
    with pytest.raises(FormatError) as caught:
        structured_output(body)
    assert caught.value.param == param
