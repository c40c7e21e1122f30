"""llama-server's /completion request -> the engine's: its prompt read as llama-server reads it
(server-common.cpp, tokenize_input_prompts), run as a /v1/completions request of those tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..runtime.generation import Generation
from ..runtime.models import ServedModel
from ..wire.native import Bias, NativeChoice, NativeCompletionRequest, PromptObject
from ..wire.protocol import RequestError
from .fim import text_tokens
from .prepare import prepare_completion


def _one(served: ServedModel, item: Any, param: str) -> list[int]:
    """One prompt: text, ids, a mix of both, or the multimodal object's text (media refused)."""
    if isinstance(item, PromptObject):
        if item.multimodal_data:
            raise RequestError(400, f"{param}.multimodal_data: this route takes no media here; "
                               "/v1/chat/completions with image parts does", param=f"{param}.multimodal_data")
        item = item.prompt_string
    if isinstance(item, int):
        item = [item]
    return text_tokens(served, item, param, add_special=True, parse_special=True)


def native_prompts(served: ServedModel, prompt: str | PromptObject | list[Any]) -> list[list[int]]:
    """The prompts' tokens: a string (or object), or a list of ids and texts with at least one id,
    is one prompt (llama-server's rule); any other list holds one prompt an item."""
    if isinstance(prompt, (str, PromptObject)):
        return [_one(served, prompt, "prompt")]
    if any(isinstance(item, int) for item in prompt):
        if any(isinstance(item, (list, PromptObject)) for item in prompt):
            raise RequestError(400, "prompt: a list of token ids cannot hold lists or objects", param="prompt")
        return [_one(served, prompt, "prompt")]
    if not prompt:
        raise RequestError(400, "prompt: the list is empty", param="prompt")
    return [_one(served, item, f"prompt.{i}") for i, item in enumerate(prompt)]


def bias_by_id(served: ServedModel, bias: Bias | None) -> dict[str, float] | None:
    """llama-server's logit_bias as OpenAI's (token ids as keys): a key that is not a number is
    text, each of its tokens biased (server-task.cpp); `false` is -100, OpenAI's ban, where
    llama-server's is -inf (the engine takes -100..100). The ids are checked where OpenAI's are."""
    if bias is None:
        return None
    by_id: dict[str, float] = {}
    for key, given in bias.items() if isinstance(bias, dict) else bias:
        if given is True:  # llama-server skips it
            continue
        value = -100.0 if given is False else given
        if isinstance(key, str) and not key.strip().lstrip("-").isdigit():
            by_id.update((str(t), value) for t in served.model.tokenize(key, add_special=False, parse_special=False))
        else:
            by_id[str(key).strip()] = value
    return by_id


@dataclass(frozen=True)
class NativePrepared:
    prompts: list[list[int]]  # each prompt's tokens
    texts: list[str]  # each prompt's text (the answer's `prompt`), where the answer shows it
    generation: Generation | None  # None for n_predict 0: empty answers, nothing to run


def prepare_native(served: ServedModel, body: NativeCompletionRequest) -> NativePrepared:
    """The prompts and their generation (native_choices)."""
    prompts = native_prompts(served, body.checked().prompt)
    for i, tokens in enumerate(prompts):
        served.prompts.limit.check_tokens(tokens, f"prompt.{i}" if len(prompts) > 1 else "prompt")
    shown = not body.response_fields or "prompt" in body.response_fields
    texts = [served.model.detokenize(tokens) for tokens in prompts] if shown else []
    if body.n_predict == 0:
        return NativePrepared(prompts, texts, None)
    generation = prepare_completion(served, body.completion(prompts, logit_bias=bias_by_id(served, body.logit_bias)))
    return NativePrepared(prompts, texts, native_choices(generation, body.return_tokens, body.n_probs > 0))


def native_choices(generation: Generation, ids: bool, probs: bool) -> Generation:
    """The generation, its choices keeping their token ids (`tokens`) and probabilities
    (`completion_probabilities`) where the request asks for them."""
    if ids or probs:
        piece = generation.served.model.piece
        generation.choices = [NativeChoice(i, piece, ids, probs) for i in range(len(generation.choices))]
    return generation
