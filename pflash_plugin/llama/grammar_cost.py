"""What a GBNF grammar will cost llama.cpp, estimated before llama.cpp builds it.

llama.cpp keeps a grammar's parse state as a list of stacks, expanded through every alternative and
every optional at once and deduplicated by a linear search. A flat alternation of n literals starts
with n stacks, and each token step pays per stack times the vocabulary (20,000 literals: 8 s a token
on a 262K vocabulary). Nested optionals (`r{i} ::= r{i+1}? r{i+1}?`) double the stacks per level,
and every character a token step takes re-expands them all again (per token on the tiny test
model: 3 ms at 5 levels, 0.25 s at 7, 22 s at 9).

This parses the grammar as llama.cpp does (the same rewriting of groups and repetitions into rules)
and counts, for every position a stack can hold, the stacks llama.cpp's expansion reaches from it
(`stacks`), and an upper bound of those it expands again after one character (`expansions`). It does
not see a stack count that grows token after token (an ambiguous grammar such as
`r ::= "a" r "b" | "a" r "c" | ""`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# llama.cpp's bound on what one repetition may expand to (grammar-parser's MAX_REPETITION_THRESHOLD)
_MAX_REPETITION = 2000
_SATURATED = 10**18  # counts stop growing here (exponential ones would be huge integers)

# A symbol of a rule's alternative: a rule id (>= 0), or a terminal written as minus its llama.cpp
# element count (a literal "abc" is three elements, one stack position in effect).
Symbol = int


class GrammarSyntaxError(ValueError):
    pass


@dataclass(frozen=True)
class GrammarCost:
    stacks: int  # the most parse stacks one expansion reaches (a build or token step pays per stack)
    expansions: int  # the most stacks re-expanded after one character (an upper bound)
    elements: int  # llama.cpp's grammar elements after its rewriting (its memory)
    rules: int


def grammar_cost(grammar: str) -> GrammarCost:
    """The cost of `grammar` (rule `root`); GrammarSyntaxError where llama.cpp would not parse it."""
    parser = _Parser(grammar.split("\0", 1)[0])  # llama.cpp reads a C string
    parser.parse()
    rules = parser.checked_rules()
    nullable = _nullable(rules)
    order = _left_corner_order(rules, nullable)
    stacks = [0] * len(rules)  # per rule: the stacks an expansion of a reference reaches inside it
    for r in order:  # position 0 reads only its left corner's rules, which come before r in `order`
        stacks[r] = _saturate(sum(_positions_stacks(alt, stacks, nullable)[0] for alt in rules[r]))
    after = [[_positions_stacks(alt, stacks, nullable) for alt in alts] for alts in rules]
    pops = [0] * len(rules)  # per rule: the stacks its expansions reach again after one character
    for r in order:
        pops[r] = _saturate(sum((_positions_pops(alt, after[r][k], stacks, pops, nullable) or [0])[0]
                                for k, alt in enumerate(rules[r])))
    most_stacks = max([stacks[parser.names["root"]]] + [n for alts in after for ns in alts for n in ns])
    most_pops = max([pops[parser.names["root"]]]
                    + [n for r, alts in enumerate(rules) for k, alt in enumerate(alts)
                       for n in _positions_pops(alt, after[r][k], stacks, pops, nullable)])
    return GrammarCost(most_stacks, most_pops, parser.elements, len(rules))


def _saturate(n: int) -> int:
    return min(n, _SATURATED)


def _nullable(rules: list[list[list[Symbol]]]) -> list[bool]:
    """Which rules can match the empty string (a fixed point)."""
    nullable = [False] * len(rules)
    changed = True
    while changed:
        changed = False
        for r, alts in enumerate(rules):
            if not nullable[r] and any(all(s >= 0 and nullable[s] for s in alt) for alt in alts):
                nullable[r] = changed = True
    return nullable


def _left_corner(alts: list[list[Symbol]], nullable: list[bool]) -> list[int]:
    """The rules llama.cpp expands from a rule's start: refs up to each alternative's first
    non-nullable symbol."""
    refs = []
    for alt in alts:
        for s in alt:
            if s < 0:
                break
            refs.append(s)
            if not nullable[s]:
                break
    return refs


def _left_corner_order(rules: list[list[list[Symbol]]], nullable: list[bool]) -> list[int]:
    """The rules in post-order over left-corner references (a rule after those it expands first),
    found iteratively (chains of rules run thousands deep); a cycle is left recursion, which
    llama.cpp refuses too."""
    order: list[int] = []
    done = [False] * len(rules)
    for root in range(len(rules)):
        if done[root]:
            continue
        on_path = {root}
        todo = [(root, iter(_left_corner(rules[root], nullable)))]
        while todo:
            rule, pending = todo[-1]
            child = next((s for s in pending if not done[s]), None)
            if child is None:
                order.append(rule)
                done[rule] = True
                on_path.discard(rule)
                todo.pop()
            elif child in on_path:
                raise GrammarSyntaxError("the grammar is left-recursive")
            else:
                on_path.add(child)
                todo.append((child, iter(_left_corner(rules[child], nullable))))
    return order


def _positions_stacks(alt: list[Symbol], stacks: list[int], nullable: list[bool]) -> list[int]:
    """The stacks reached from each position of `alt`, and 0 for its end: a terminal is one
    stack; a reference, its rule's stacks, and what follows it where the rule can be empty."""
    counts = [0] * (len(alt) + 1)
    for i in range(len(alt) - 1, -1, -1):
        s = alt[i]
        counts[i] = 1 if s < 0 else _saturate(stacks[s] + (counts[i + 1] if nullable[s] else 0))
    return counts


def _positions_pops(alt: list[Symbol], after: list[int], stacks: list[int], pops: list[int],
                    nullable: list[bool]) -> list[int]:
    """Per position, the stacks llama.cpp expands again once the stacks reached from there take
    one character: a terminal's continuation; for a reference, its rule's own, plus the
    continuation after it for each of the rule's stacks (each may end the rule: an upper bound),
    plus the next position's where the rule can be empty."""
    counts = [0] * (len(alt) + 1)
    for i in range(len(alt) - 1, -1, -1):
        s = alt[i]
        counts[i] = after[i + 1] if s < 0 else _saturate(
            pops[s] + stacks[s] * after[i + 1] + (counts[i + 1] if nullable[s] else 0))
    return counts[:len(alt)]


# one pass over a grammar's text: the inert spans (literals, classes, tokens, comments) whole, then
# what nests or adds rules (groups, `::=`, repetition operators and bounds)
_SHAPE_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\[[^\]\\]*(?:\\.[^\]\\]*)*\]|<[^>]*>|#[^\n]*'
                          r"|(\()|(\))|::=|[*+?]|\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class GrammarShape:
    nesting: int  # the deepest group nesting
    rules: int  # rules llama.cpp's rewriting makes, about: `::=`, groups, operators, repetitions


def grammar_shape(grammar: str, max_nesting: int, max_rules: int) -> GrammarShape:
    """A grammar's nesting and rule count, read in one pass of constant memory (an array the size of
    the grammar was 1.19 GiB for one of 160 million characters), stopping as soon as either passes
    its bound: what this returns is then over that bound."""
    depth = nesting = rules = 0
    for token in _SHAPE_TOKEN.finditer(grammar):
        opened, closed, low, high = token.groups()
        text = token.group()
        if opened:
            depth += 1
            nesting = max(nesting, depth)
            rules += 1
        elif closed:
            depth -= 1
        elif text in ("::=", "*", "+", "?"):
            rules += 1
        elif low is not None:
            rules += max(repetition_bound(low), repetition_bound(high or ""))
        if nesting > max_nesting or rules > max_rules:
            break
    return GrammarShape(nesting, rules)


def repetition_bound(digits: str) -> int:
    """A repetition bound's digits as a number, saturated at 10**7, past llama.cpp's limits either way
    (Python refuses to read ints of over 4,300 digits)."""
    digits = digits.lstrip("0")
    return int(digits or "0") if len(digits) <= 7 else 10**7


class _Parser:
    """llama.cpp's GBNF parser (llama-grammar.cpp), building symbols instead of elements."""

    def __init__(self, src: str) -> None:
        self.src, self.pos = src, 0
        self.names: dict[str, int] = {}
        self.rules: list[list[list[Symbol]] | None] = []
        self.elements = 0

    def parse(self) -> None:
        self._space(True)
        while self.pos < len(self.src):
            self._rule()

    def checked_rules(self) -> list[list[list[Symbol]]]:
        if "root" not in self.names:
            raise GrammarSyntaxError("the grammar has no 'root' rule")
        undefined = [name for name, i in self.names.items() if self.rules[i] is None]
        if undefined:
            raise GrammarSyntaxError(f"the grammar uses undefined rule '{undefined[0]}'")
        return [alts for alts in self.rules if alts is not None]

    def _error(self, what: str) -> GrammarSyntaxError:
        return GrammarSyntaxError(f"the grammar could not be parsed: {what} at offset {self.pos}")

    def _peek(self, k: int = 0) -> str:
        i = self.pos + k
        return self.src[i] if i < len(self.src) else ""

    def _space(self, newline_ok: bool) -> None:
        while True:
            c = self._peek()
            if c == "#":
                while self._peek() not in ("", "\r", "\n"):
                    self.pos += 1
            elif c in (" ", "\t") or (newline_ok and c in ("\r", "\n")):
                self.pos += 1
            else:
                return

    def _name(self) -> str:
        start = self.pos
        while _is_word_char(self._peek()):
            self.pos += 1
        if self.pos == start:
            raise self._error("expecting a name")
        return self.src[start:self.pos]

    def _symbol(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = self._new_rule()
        return self.names[name]

    def _new_rule(self) -> int:
        self.rules.append(None)
        return len(self.rules) - 1

    def _define(self, rule: int, alts: list[list[Symbol]]) -> None:
        self.rules[rule] = alts
        self.elements += sum(_weight(s) for alt in alts for s in alt) + len(alts)  # + ALT/END

    def _rule(self) -> None:
        rule = self._symbol(self._name())
        self._space(False)
        if self.src[self.pos:self.pos + 3] != "::=":
            raise self._error("expecting ::=")
        self.pos += 3
        self._space(True)
        self._define(rule, self._alternates(False))
        if self._peek() == "\r":
            self.pos += 2 if self._peek(1) == "\n" else 1
        elif self._peek() == "\n":
            self.pos += 1
        elif self._peek():
            raise self._error("expecting newline or end")
        self._space(True)

    def _alternates(self, nested: bool) -> list[list[Symbol]]:
        alts = [self._sequence(nested)]
        while self._peek() == "|":
            self.pos += 1
            self._space(True)
            alts.append(self._sequence(nested))
        return alts

    def _sequence(self, nested: bool) -> list[Symbol]:
        seq: list[Symbol] = []
        last = 0  # where the symbol a repetition applies to starts
        n_prev_rules = 1
        while True:
            c = self._peek()
            if c in ('"', "[", "<", "!", ".") or _is_word_char(c):
                last, n_prev_rules = len(seq), 1
                seq.extend(self._atom(c))
            elif c == "(":
                self.pos += 1
                self._space(True)
                before = len(self.rules)
                group = self._new_rule()
                self._define(group, self._alternates(True))
                if self._peek() != ")":
                    raise self._error("expecting ')'")
                self.pos += 1
                n_prev_rules = max(1, len(self.rules) - before)
                last = len(seq)
                seq.append(group)
            elif c in ("*", "+", "?", "{"):
                low, high = self._bounds(nested)
                n_prev_rules = self._repeat(seq, last, low, high, n_prev_rules)
                continue
            else:
                return seq
            self._space(nested)

    def _atom(self, c: str) -> list[Symbol]:
        """A literal, character class, token, any-char or rule reference (the space after is the caller's)."""
        if c == '"':
            self.pos += 1
            n = self._chars('"')
            return [-n] if n else []  # "" matches the empty string: no element at all
        if c == "[":
            self.pos += 1
            if self._peek() == "^":
                self.pos += 1
            n = self._chars("]", ranges=True)
            # an empty class: llama.cpp's parse expands through it as through nothing, so it is
            # counted as nothing (as a 1-character terminal it would hide what follows it)
            return [-n] if n else []
        if c in ("<", "!"):
            self._token(c == "!")
            return [-1]
        if c == ".":
            self.pos += 1
            return [-1]
        return [self._symbol(self._name())]

    def _chars(self, end: str, ranges: bool = False) -> int:
        """Reads characters up to `end` (consumed); their element count."""
        n = 0
        while self._peek() != end:
            self._char()
            n += 1
            if ranges and self._peek() == "-" and self._peek(1) != "]":
                if not self._peek(1):
                    raise self._error("unexpected end of input")
                self.pos += 1
                self._char()
                n += 1
        self.pos += 1
        return n

    def _char(self) -> None:
        c = self._peek()
        if not c:
            raise self._error("unexpected end of input")
        if c != "\\":
            self.pos += 1
            return
        escape = self._peek(1)
        size = {"x": 2, "u": 4, "U": 8}.get(escape)
        if size is not None:
            digits = self.src[self.pos + 2:self.pos + 2 + size]
            if len(digits) != size or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self._error(f"expecting {size} hex chars")
            self.pos += 2 + size
        elif escape in ("t", "r", "n", "\\", '"', "[", "]", "-"):
            self.pos += 2
        else:
            raise self._error("unknown escape")

    def _token(self, inverse: bool) -> None:
        if inverse:
            self.pos += 1
        if self._peek() != "<":
            raise self._error("expecting '<'")
        end = self.src.find(">", self.pos)
        if end < 0:
            raise self._error("expecting '>'")
        self.pos = end + 1  # llama.cpp checks the token itself against the vocabulary

    def _bounds(self, nested: bool) -> tuple[int, int | None]:
        """The repetition operator at pos: (min, max), max None for no limit."""
        c = self._peek()
        self.pos += 1
        self._space(nested)
        if c != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        low = self._int()
        self._space(nested)
        high: int | None = low
        if self._peek() == ",":
            self.pos += 1
            self._space(nested)
            high = self._int() if self._peek().isdigit() else None
            self._space(nested)
        if self._peek() != "}":
            raise self._error("expecting '}'")
        self.pos += 1
        self._space(nested)
        if low > _MAX_REPETITION:
            raise self._error("a repetition over llama.cpp's limit")
        return low, None if high is not None and high > _MAX_REPETITION else high

    def _int(self) -> int:
        start = self.pos
        while self._peek() in tuple("0123456789"):
            self.pos += 1
        if self.pos == start:
            raise self._error("expecting an integer")
        return repetition_bound(self.src[start:self.pos])

    def _repeat(self, seq: list[Symbol], last: int, low: int, high: int | None, n_prev_rules: int) -> int:
        """llama.cpp's rewriting: S{m,n} -> S (m times) S'(n-m), S'(x) ::= S S'(x-1) | ;
        S{m,} -> S (m times) S', S' ::= S S' | . Returns the rules repeated so far (its limit)."""
        if last == len(seq):
            raise self._error("expecting an item before a repetition")
        total = high if high else (low if low > 0 else 1)
        if n_prev_rules * total > _MAX_REPETITION:
            raise self._error("repetitions over llama.cpp's limit")
        item = seq[last:]
        del seq[last:]
        seq.extend(item * low)
        n_opt = 1 if high is None else high - low
        previous = 0
        for i in range(n_opt):
            rule = self._new_rule()
            tail = [rule] if high is None else ([previous] if i > 0 else [])
            self._define(rule, [item + tail, []])
            previous = rule
        if n_opt > 0:
            seq.append(previous)
        return n_prev_rules * total


def _weight(symbol: Symbol) -> int:
    return -symbol if symbol < 0 else 1


def _is_word_char(c: str) -> bool:
    return c != "" and (c.isascii() and (c.isalnum() or c == "-"))
