"""The OpenAI door's output formats -> StructuredOutput (protos/model.proto).

Accepted, at most one per request (both endpoints, as vLLM):
- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`;
- vLLM's `structured_outputs`: one of `json` (a schema object or its JSON text), `json_object`
  (true), `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF);
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Anything else in them is a 400 naming the field: a format this server cannot enforce is never
silently dropped. Whether a schema or grammar compiles is the model service's answer (a 400 too).
"""

from __future__ import annotations

import json
from typing import Any

from protos import model_pb2

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
FIELDS = ("response_format", "structured_outputs", *GUIDED)


class FormatError(ValueError):
    """A 400: `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_output(body: dict[str, Any]) -> model_pb2.StructuredOutput | None:
    """The request's output format, None for free text. Raises FormatError."""
    given = [name for name in FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise FormatError(f"give at most one of {', '.join(given)}", given[1])
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise FormatError("'structured_outputs' must be an object", name)
        unknown = sorted(set(value) - set(STRUCTURED_KEYS))
        if unknown:
            raise FormatError(f"'structured_outputs' does not support {', '.join(unknown)} here", name)
        kinds = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
        if len(kinds) != 1:
            raise FormatError(f"'structured_outputs' needs exactly one of {', '.join(STRUCTURED_KEYS)}", name)
        return _of(kinds[0], value[kinds[0]], f"{name}.{kinds[0]}")
    return _of(GUIDED[name], value, name)


def _response_format(value: Any) -> model_pb2.StructuredOutput | None:
    name = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FormatError("'response_format' must be an object with a string 'type'", name)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return model_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise FormatError("'response_format.json_schema' must be an object with a 'schema'", name)
        return _of("json", spec["schema"], f"{name}.json_schema.schema")
    raise FormatError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)", name)


def _of(kind: str, value: Any, param: str) -> model_pb2.StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            text = value
        elif isinstance(value, dict | bool):
            text = json.dumps(value)
        else:
            raise FormatError(f"'{param}' must be a JSON schema (an object or its JSON text)", param)
        return model_pb2.StructuredOutput(json_schema=text)
    if kind == "json_object":
        if value is not True:
            raise FormatError(f"'{param}' must be true", param)
        return model_pb2.StructuredOutput(json_object=True)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise FormatError(f"'{param}' must be a non-empty list of strings", param)
        return model_pb2.StructuredOutput(choice=model_pb2.Choices(choices=value))
    if not isinstance(value, str) or not value.strip():
        raise FormatError(f"'{param}' must be a non-empty string", param)
    return model_pb2.StructuredOutput(regex=value) if kind == "regex" else model_pb2.StructuredOutput(grammar=value)
