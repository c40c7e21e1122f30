"""The grammar cost estimate (llama/grammar_cost.py) against llama.cpp itself: it parses what
llama.cpp parses, refuses what llama.cpp refuses, and counts the stacks llama.cpp's parse keeps."""
from __future__ import annotations

import json

import llama_cpp.llama_cpp as C
import pytest
from llama_cpp import llama_grammar

from pflash_plugin.llama import Model
from pflash_plugin.llama.grammar_cost import GrammarSyntaxError, grammar_cost
from pflash_plugin.testing.native_fuzz import GRAMMARS, alternation, nested_optionals

SCHEMAS = [
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20)}, "required": ["p3"]},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "object"}]},
                                      "b": {"type": "string", "format": "date-time"},
                                      "c": {"type": "string", "pattern": "^[a-z]{3,10}-[0-9]+$"},
                                      "d": {"type": "array", "items": {"type": "integer"}, "maxItems": 20}}},
    {"type": "string", "minLength": 5, "maxLength": 60},
]
MORE = [
    'root ::= "a" # comment\n  | "b"\n', "root ::= x\nx ::= [a-c\\]\\-] . x | \"\"",
    'root ::= "\\x41\\u00e9\\U0001F600\\t"', "root ::= ( \"a\"\n  \"b\" )+", "root ::= \"a\"\nroot ::= \"b\"",
    'root ::= [^"\\\\]{2,}', "root ::= a\na ::= a \"x\"",
    'root ::= "a"{3', "root ::= \"a\" |", "root ::= x?\nx ::= \"\" x", 'root ::= "\\q"', "root ::= [a-", "root::=\"a\"",
    'root ::= "a"*?+', 'root ::= "a" "b"{0}', "root ::= \"\"{2}", "root ::= ()",
]


def llama_cpp_parses(model: Model, grammar: str) -> bool:
    sampler = C.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
    if sampler:
        C.llama_sampler_free(sampler)
    return bool(sampler)


def parses(grammar: str) -> bool:
    try:
        grammar_cost(grammar)
        return True
    except GrammarSyntaxError:
        return False


def test_it_parses_exactly_what_llama_cpp_parses(tiny_model):
    model = Model(str(tiny_model))
    schemas = [llama_grammar.json_schema_to_gbnf(json.dumps(s)) for s in SCHEMAS]
    grammars = [g for g in GRAMMARS if g.count("(") < 256] + schemas + MORE + [llama_grammar.JSON_GBNF]
    verdicts = [(g[:60], parses(g), llama_cpp_parses(model, g)) for g in grammars]
    assert [v for v in verdicts if v[1] != v[2]] == []
    assert sum(ours for _, ours, _ in verdicts) >= len(grammars) // 2  # most are valid


@pytest.mark.parametrize("depth", [1, 5, 9, 17, 60])
def test_nested_optionals_double_the_stacks_per_level(depth):
    cost = grammar_cost(nested_optionals(depth))
    assert cost.stacks == min(2**depth, 10**18)  # counts saturate
    assert cost.expansions >= min(4**depth // 4, 10**18)  # every character re-expands them all


@pytest.mark.parametrize("empty", ["[]", "[^]"])
def test_an_empty_character_class_hides_no_nested_optionals(empty):
    """llama.cpp expands through `[]`; counted as a terminal it hid 2^16 stacks whose build took
    seconds on the engine thread (a review found it)."""
    grammar = "root ::= r0\n" + "".join(f"r{i} ::= {empty} r{i + 1}? r{i + 1}?\n" for i in range(16)) + 'r16 ::= "a"'
    assert grammar_cost(grammar).stacks == 2**16
    assert grammar_cost(f'root ::= {empty} "a"').stacks == 1  # not a reference to rule 0 (left recursion)


def test_an_alternation_keeps_one_stack_per_literal_and_re_expands_none():
    cost = grammar_cost(alternation(5000))
    assert (cost.stacks, cost.expansions) == (5000, 0)


def test_repetitions_are_counted_as_llama_cpp_rewrites_them():
    cost = grammar_cost('root ::= "abcd"{1000} x{0,3}\nx ::= "y"')
    # root: the copies, a ref, END; x: "y", END; x's 3 optional rules: x [ref] ALT END (the first has no ref)
    assert cost.elements == (4 * 1000 + 2) + 2 + (3 + 4 + 4)
    assert cost.rules == 5


def test_left_recursion_is_refused_without_recursing():
    chain = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} \"a\"\n" for i in range(5000)) + "r5000 ::= r0"
    with pytest.raises(GrammarSyntaxError, match="left-recursive"):
        grammar_cost(chain)


def test_a_grammar_that_passed_is_not_parsed_again(monkeypatch):
    """The server checks a grammar on a worker thread; the engine's sampler checks it again on the
    engine thread, where a Python parse of a 4 MB literal (about 1 s) would stall every client."""
    from pflash_plugin.llama import sampler

    grammar = 'root ::= "' + "a" * 100_000 + '" [0-9]'
    sampler.check_grammar_size(grammar)

    def parse_again(_: str):
        raise AssertionError("parsed again")

    monkeypatch.setattr(sampler, "grammar_cost", parse_again)
    sampler.check_grammar_size(grammar)
    with pytest.raises(AssertionError, match="parsed again"):
        sampler.check_grammar_size(grammar + " ")  # another grammar is parsed
