"""What a request may constrain its output to, and the llguidance grammar of each kind.

Kinds (as vLLM's `structured_outputs` and OpenAI's `response_format` name them):
- `json_schema`: a JSON Schema (text); the output is JSON valid against it.
- `json_object`: any JSON object.
  JSON is generated compact (`", "` and `": "` separators, no other whitespace, as `json.dumps`):
  free whitespace lets a model pad forever between tokens.
- `regex`: a regular expression the whole output matches (Rust `regex` syntax, as llguidance's).
- `choice`: exactly one of a list of strings.
- `grammar`: a context-free grammar, in llguidance's Lark dialect or in GBNF (llama.cpp's, told
  apart by its `::=` rules; converted to Lark).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Bounds on what one request may send (each grammar is compiled and kept in a cache).
MAX_SPEC_BYTES = 64 << 10
MAX_CHOICES = 1024
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """One request's output constraint: `kind` (one of KINDS) and its text (`choices` for choice)."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        size = len(self.text.encode()) + sum(len(c.encode()) for c in self.choices)
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"the structured output {self.kind} is {size} bytes, more than {MAX_SPEC_BYTES}")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise ValueError(f"a choice needs 1 to {MAX_CHOICES} strings, got {len(self.choices)}")
            if any(c == "" for c in self.choices):
                raise ValueError("a choice must not be the empty string")
        elif self.kind != "json_object" and not self.text.strip():
            raise ValueError(f"the structured output {self.kind} is empty")


def spec_from_proto(message: object) -> StructuredSpec | None:
    """A `StructuredOutput` message (protos/model.proto) as a spec; None when no kind is set.
    ValueError as StructuredSpec's."""
    kind = message.WhichOneof("kind")  # type: ignore[attr-defined]
    if kind is None:
        return None
    value = getattr(message, kind)
    if kind == "json_object":
        return StructuredSpec("json_object") if value else None
    if kind == "choice":
        return StructuredSpec("choice", choices=tuple(value.choices))
    return StructuredSpec(kind, value)


@functools.lru_cache(maxsize=512)
def grammar_of(spec: StructuredSpec) -> str:
    """The llguidance grammar (its JSON form) of `spec`; ValueError when the text does not parse
    as its kind (a JSON schema that is not JSON, say). Cached per spec: a schema sent by every
    request of an application is converted once."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object (or true / false)")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_COMPACT)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in spec.choices)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    text = spec.text
    if "::=" in text:  # GBNF
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # its converter raises several kinds on bad GBNF
            raise ValueError(f"the GBNF grammar does not parse: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)
