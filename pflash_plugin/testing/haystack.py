"""Needle-in-a-haystack prompts for the demo model (completion style: the question at the end)."""
from __future__ import annotations

import random
from typing import Callable

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


def fit_needle_prompt(count: Callable[[str], int], n_tokens: int, kind: str, depth: float, seed: int,
                      attempts: int = 3) -> tuple[str, str, int]:
    """A needle prompt of about `n_tokens` tokens as `count` measures them: the word count is scaled
    by the tokenizer's answer until within 3%. Returns the prompt, its code and its token count."""
    words = int(n_tokens * 0.9)
    for _ in range(attempts):
        prompt, code = needle_prompt(words, depth, seed, kind)
        n = count(prompt)
        if abs(n - n_tokens) <= n_tokens * 0.03:
            break
        words = int(words * n_tokens / n)
    return prompt, code, n
