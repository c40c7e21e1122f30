"""What a request's output must follow, in the form its engine runs: llguidance grammar text (the
JSON schema itself where the request has one, else its GBNF through llguidance's GBNF -> Lark), or
llama.cpp's GBNF for its grammar sampler: under `--constraint_engine llama`, and as the fallback for
a grammar llguidance refuses. Checked here, on the route's thread, before any stream starts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...engine.constraints import ConstraintError, check_constraint, compile_gbnf, compile_schema
from ...llama import GrammarError, check_grammar
from ...llama.sampler import check_grammar_size
from ..runtime.models import ServedModel
from ..wire.protocol import RequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Constrained:
    """A request's constraint: at most one of the two is set."""

    grammar: str | None = None  # llama.cpp GBNF (SamplingParams.grammar)
    constraint: str | None = None  # llguidance grammar text (SamplingParams.constraint)

    def __bool__(self) -> bool:
        return bool(self.grammar or self.constraint)


def constrained(served: ServedModel, gbnf: str | None, param: str,
                schema: dict[str, Any] | None = None) -> Constrained:
    """The constraint of a GBNF grammar (and of the JSON schema it was written from, if any).
    The GBNF's size bounds apply to both engines (they bound what either compiles)."""
    if not gbnf:
        return Constrained()
    try:
        check_grammar_size(gbnf)
    except GrammarError as error:
        raise RequestError(400, f"{param}: {error}", param=param) from None
    if served.settings.constraint_engine == "llguidance":
        constraint = _guidance(served, gbnf, schema)
        if constraint is not None:
            return Constrained(constraint=constraint)
    try:
        check_grammar(served.model, gbnf)
    except GrammarError as error:
        raise RequestError(400, f"{param}: {error}", param=param) from None
    return Constrained(grammar=gbnf)


def _guidance(served: ServedModel, gbnf: str, schema: dict[str, Any] | None) -> str | None:
    """llguidance's grammar of the schema, else of the GBNF; None where it refuses both."""
    compilers = ([lambda: compile_schema(schema)] if schema is not None else []) + [lambda: compile_gbnf(gbnf)]
    refusals = []
    for compile_one in compilers:
        try:
            grammar = compile_one()
            check_constraint(served.model, grammar)
            return grammar
        except ConstraintError as error:
            refusals.append(str(error))
    log.info("llguidance refuses a grammar (%s): llama.cpp's grammar sampler serves it", "; ".join(refusals)[:500])
    return None
