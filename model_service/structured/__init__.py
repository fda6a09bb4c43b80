"""Structured outputs: grammar-guided decoding with llguidance (JSON schema, JSON object, regex,
choice, Lark / GBNF grammars). See `spec.py` for what a request may ask and `guide.py` for the
per-request matchers and the batch's token masks."""

from model_service.structured.guide import GrammarCompiler, Guide, TokenMasks
from model_service.structured.spec import KINDS, StructuredSpec, spec_from_proto

__all__ = ["KINDS", "GrammarCompiler", "Guide", "StructuredSpec", "TokenMasks", "spec_from_proto"]
