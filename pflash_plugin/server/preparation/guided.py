"""The peers' guided decoding (vLLM's `guided_*` and `structured_outputs`, llama-server's
`json_schema`) as the constraint the server's engines run: a schema and a grammar as
response_format's and grammar's are, a choice as the GBNF of its alternatives, a regular
expression through llguidance (llama.cpp's GBNF has none)."""
from __future__ import annotations

from llama_cpp import llama_grammar

from ...engine.constraints import ConstraintError, check_constraint, compile_regex
from ..runtime.models import ServedModel
from ..wire.peer_fields import Guide
from ..wire.request_error import RequestError
from .constraint import Constrained, constrained
from .schema_bounds import schema_grammar

MAX_REGEX_CHARS = 8192
MAX_CHOICES = 1024


def guided(served: ServedModel, guide: Guide) -> Constrained:
    """The request's guide as a constraint, or a 400 naming its field."""
    if guide.kind == "json":
        gbnf = schema_grammar(guide.value, guide.param) if guide.value is not None else llama_grammar.JSON_GBNF
        return constrained(served, gbnf, guide.param, guide.value or None)
    if guide.kind == "choice":
        return constrained(served, choice_grammar(guide.value, guide.param), guide.param)
    if guide.kind == "grammar":
        return constrained(served, guide.value, guide.param)
    return _regex(served, guide.value, guide.param)


def choice_grammar(choices: list[str], param: str) -> str:
    """The GBNF whose outputs are exactly the choices' texts."""
    if len(choices) > MAX_CHOICES:
        raise RequestError(400, f"{param}: at most {MAX_CHOICES} choices ({len(choices)} given)", param=param)
    return "root ::= " + " | ".join(f'"{_gbnf_literal(choice)}"' for choice in choices)


def _gbnf_literal(text: str) -> str:
    """The text inside a GBNF string literal: quotes, backslashes and control characters escaped."""
    named = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(named.get(ch) or (f"\\x{ord(ch):02X}" if ord(ch) < 0x20 else ch) for ch in text)


def _regex(served: ServedModel, regex: str, param: str) -> Constrained:
    if served.settings.constraint_engine != "llguidance":
        raise RequestError(400, f"{param}: a regular expression needs --constraint_engine llguidance (llama.cpp's "
                           "grammars have none)", param=param)
    if len(regex) > MAX_REGEX_CHARS:
        raise RequestError(400, f"{param}: at most {MAX_REGEX_CHARS} characters ({len(regex)} given)", param=param)
    try:
        grammar = compile_regex(regex)
        check_constraint(served.model, grammar)
    except ConstraintError as error:
        raise RequestError(400, f"{param}: {error}", param=param) from None
    return Constrained(constraint=grammar)
