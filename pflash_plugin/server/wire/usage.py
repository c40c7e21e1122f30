"""A generation's usage, from its requests' engine records (engine/request.py `Usage`), in each
API's words: OpenAI's (chat, completions), the Responses API's and Anthropic's read one `Totals`.
Our timings (queue, compression, prefill, first token, decode; the PFlash report) go beside."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ...engine.request import Usage
from .responses import Choice


@dataclass(frozen=True)
class Totals:
    """The usage of a generation's choices together: each prompt counted once (as OpenAI does),
    completions summed, cached tokens the most any choice reused."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    choices: tuple[Usage, ...]  # in choice order

    @property
    def media_tokens(self) -> int:
        """Of prompt_tokens, those its images and audio take (the choices share one prompt)."""
        return self.choices[0].media_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def totals(usages: list[Usage], prompt_tokens: int) -> Totals:
    """`usages` in choice order; `prompt_tokens`: the generation's prompts, each counted once."""
    if len(usages) == 1:
        one = usages[0]
        return Totals(one.prompt_tokens, one.completion_tokens, one.cached_tokens, (one,))
    cached = max(u.cached_tokens for u in usages)
    return Totals(prompt_tokens, sum(u.completion_tokens for u in usages), min(prompt_tokens, cached), tuple(usages))


def _timings(usage: Usage) -> dict[str, Any]:
    timings: dict[str, Any] = {**asdict(usage.latency), "cached_tokens": usage.cached_tokens}
    if usage.media_tokens:
        timings["media_tokens"] = usage.media_tokens
    if usage.pflash is not None:
        timings["pflash"] = usage.pflash.to_json()
    if usage.clock is not None:
        timings["clock"] = usage.clock
    return timings


def timings(used: Totals) -> dict[str, Any]:
    """`usage.timings`: the first choice's, and every choice's under `choices` when there are several."""
    first = _timings(used.choices[0])
    if len(used.choices) == 1:
        return first
    return {**first, "choices": [_timings(u) for u in used.choices]}


def reasoning_tokens(choices: Sequence[Choice]) -> int:
    """The completion tokens the choices spent thinking (their reasoning readers count them)."""
    return sum(choice.reasoning_tokens for choice in choices)


def _details(used: Totals) -> dict[str, int]:
    """prompt_tokens_details (input_tokens_details): the cached tokens, and where the prompt had
    images or audio the tokens they take (llama-server reports none; the name is ours)."""
    details = {"cached_tokens": used.cached_tokens}
    if used.media_tokens:
        details["media_tokens"] = used.media_tokens
    return details


def openai_usage(used: Totals, reasoning: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object, with our timings; `reasoning`: the chat choices' reasoning tokens
    (None: a completion, which has no such details)."""
    usage: dict[str, Any] = {
        "prompt_tokens": used.prompt_tokens,
        "completion_tokens": used.completion_tokens,
        "total_tokens": used.total_tokens,
        "prompt_tokens_details": _details(used),
    }
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return {**usage, "timings": timings(used)}


def responses_usage(used: Totals, reasoning: int = 0) -> dict[str, Any]:
    """The Responses API's usage, with our timings."""
    return {"input_tokens": used.prompt_tokens, "output_tokens": used.completion_tokens,
            "total_tokens": used.total_tokens, "input_tokens_details": _details(used),
            "output_tokens_details": {"reasoning_tokens": reasoning}, "timings": timings(used)}


def anthropic_usage(used: Totals) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those not read from the cache; our timings beside."""
    return {"input_tokens": used.prompt_tokens - used.cached_tokens, "output_tokens": used.completion_tokens,
            "cache_read_input_tokens": used.cached_tokens, "cache_creation_input_tokens": 0,
            "timings": timings(used)}
