"""Needle-in-a-haystack prompts for the demo model (completion style: the question at the end)."""
from __future__ import annotations

import random
from typing import Callable, TypeVar

T = TypeVar("T")

_WORDS = (
    "the river town market morning light stone bridge old keeper garden winter road letter window "
    "quiet harbor boat rope lantern field wheat miller bread oven smoke hill path forest deer fox "
    "north wind rain roof candle book story teacher school child song evening bell tower clock"
).split()

_CODE_LINES = [
    "def load_{n}(path):", "    with open(path) as handle:", "        data = handle.read()",
    "    return parse_{n}(data)", "", "class Record{n}:", "    def __init__(self, key, value):",
    "        self.key = key", "        self.value = value", "    def __repr__(self):",
    "        return f'Record{n}({{self.key}})'", "",
]

QUESTION = "\n\nQuestion: What is the vault access code?\nAnswer: The vault access code is"
MULTI_VALUE_QUESTION = "\n\nQuestion: What are all the vault access codes?\nAnswer: The vault access codes are"
# the quality gate's kinds (bench/pflash_quality.py): one needle, one key among others, several values of one key
QUALITY_KINDS = ("single", "multikey", "multivalue")
TOKENS_PER_VALUE = 8  # answer tokens a gate prompt gets per value: a 4-digit code and a separator


def prose(rng: random.Random, n_sentences: int) -> list[str]:
    sentences = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 16))]
        sentences.append(" ".join(words).capitalize() + ".")
    return sentences


def code(rng: random.Random, n_lines: int) -> list[str]:
    return [rng.choice(_CODE_LINES).format(n=rng.randint(1, 99)) for _ in range(n_lines)]


def needle_prompt(n_words_target: int, depth: float, seed: int, kind: str = "prose") -> tuple[str, str]:
    """A haystack of about `n_words_target` words with a 4-digit code hidden at `depth` (0..1).

    kind: "prose", "code" (Python-like lines), or "multi" (prose with two distractor codes for
    other doors at other depths: retrieval must pick the vault's)."""
    rng = random.Random(seed)
    code_value = str(rng.randint(1000, 9999))
    units = code(rng, n_words_target // 4) if kind == "code" else prose(rng, n_words_target // 12)
    if kind == "multi":
        for door, at in (("garden gate", (depth + 0.33) % 1.0), ("tower door", (depth + 0.66) % 1.0)):
            units.insert(int(len(units) * at), f"The {door} code is {rng.randint(1000, 9999)}.")
    needle = f"The vault access code is {code_value}. Remember it: {code_value}."
    units.insert(int(len(units) * depth), needle)
    sep = "\n" if kind == "code" else " "
    return sep.join(units) + QUESTION, code_value


def multi_value_prompt(n_words_target: int, depth: float, seed: int, n_values: int = 3) -> tuple[str, list[str]]:
    """A prose haystack with `n_values` different codes under the one key (the vault), the first at
    `depth` and the others spread evenly after it (wrapping): retrieval must find every one."""
    rng = random.Random(seed)
    values = [str(v) for v in rng.sample(range(1000, 10000), n_values)]
    units = prose(rng, n_words_target // 12)
    for i, value in enumerate(values):
        units.insert(int(len(units) * ((depth + i / n_values) % 1.0)), f"One of the vault access codes is {value}.")
    return " ".join(units) + MULTI_VALUE_QUESTION, values


def fit_tokens(count: Callable[[str], int], n_tokens: int, build: Callable[[int], tuple[str, T]],
               attempts: int = 3) -> tuple[str, T, int]:
    """The prompt `build` makes from a word count, about `n_tokens` tokens as `count` measures them:
    the word count is scaled by the tokenizer's answer until within 3%. Returns the prompt, what
    `build` returned with it (the answer) and its token count."""
    words = int(n_tokens * 0.9)
    for _ in range(attempts):
        prompt, answer = build(words)
        n = count(prompt)
        if abs(n - n_tokens) <= n_tokens * 0.03:
            break
        words = int(words * n_tokens / n)
    return prompt, answer, n


def fit_needle_prompt(count: Callable[[str], int], n_tokens: int, kind: str, depth: float, seed: int,
                      attempts: int = 3) -> tuple[str, str, int]:
    """A needle prompt of about `n_tokens` tokens (fit_tokens). Returns the prompt, its code and its
    token count."""
    return fit_tokens(count, n_tokens, lambda words: needle_prompt(words, depth, seed, kind), attempts)


def quality_prompt(count: Callable[[str], int], n_tokens: int, kind: str, depth: float,
                   seed: int) -> tuple[str, list[str], int]:
    """A prompt of the quality gate's `kind` (QUALITY_KINDS) of about `n_tokens` tokens: single is
    needle_prompt's prose, multikey its multi (the vault's code among other doors'), multivalue
    multi_value_prompt. Returns the prompt, the values to find and its token count."""
    if kind == "multivalue":
        return fit_tokens(count, n_tokens, lambda words: multi_value_prompt(words, depth, seed), attempts=4)
    needle_kind = {"single": "prose", "multikey": "multi"}[kind]
    prompt, code, n = fit_needle_prompt(count, n_tokens, needle_kind, depth, seed, attempts=4)
    return prompt, [code], n


def quality_grid(kinds: tuple[str, ...] | list[str], prompts: int, seed: int = 7000) -> list[tuple[str, float, int]]:
    """The gate's (kind, depth, seed) for `prompts` prompts per kind: depths spread evenly over
    0.1-0.9, a seed per prompt (the bench and its CI version draw the same prompts)."""
    return [(kind, round(0.1 + 0.8 * (i + 0.5) / prompts, 3), seed + 1000 * k + i)
            for k, kind in enumerate(kinds) for i in range(prompts)]


def values_found(values: list[str], answer: str) -> float:
    """The fraction of `values` in `answer`."""
    return sum(value in answer for value in values) / len(values)
