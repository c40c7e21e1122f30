"""llama-server's own request fields (tools/server/server-task.cpp, params_from_json_cmpl) shared by its
/completion and /infill: the sampling fields, n_predict, stream, response_fields; made a
/v1/completions request of token ids, which the engine runs as any other. And /completion's body:
its prompt as llama-server reads it (text, token ids, a mix of both, or a list of such prompts)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, TypeVar, Union

from pydantic import AliasChoices, BaseModel, Field, StrictBool, StrictInt

from ...engine.request import TokenOutput
from .peer_fields import LlamaServerFields
from .protocol import MAX_LOGPROBS, CompletionRequest, LoraScale, RequestError
from .responses import CompletionChoice, Piece, chat_logprobs

Mixed = Union[str, List[Union[StrictInt, str]]]  # text, or texts and token ids (llama-server's tokenize_mixed)
Body = TypeVar("Body", bound="NativeSampling")


class NativeSampling(LlamaServerFields):
    model: Optional[str] = None
    n_predict: Optional[int] = Field(
        default=None, ge=-1, validation_alias=AliasChoices("n_predict", "max_tokens", "max_completion_tokens"),
        description="Tokens at most; -1: until the context ends; 0: none (an empty answer).")
    temperature: float = 0.8
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, ge=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, description="-1 or none: random.")
    stop: List[str] = []
    repeat_penalty: float = Field(default=1.0, ge=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    grammar: Optional[str] = None
    ignore_eos: bool = False
    stream: bool = False
    n_probs: int = Field(default=0, ge=0, description="Each token's probability and the n best alternatives "
                         "(`completion_probabilities`, log-probabilities from the model before sampling).")
    post_sampling_probs: bool = False
    response_fields: Optional[List[str]] = Field(
        default=None, description="The answer's fields to send; 'a/b' sends a's b as 'a/b'.")
    # accepted and not applied (docs/api.md): the prefix cache always reuses, the engine picks slots,
    # llama-server itself ignores t_max_prompt_ms; the sampler chain's order is the server's
    cache_prompt: bool = True
    id_slot: int = -1
    t_max_prompt_ms: int = -1
    samplers: Optional[List[str]] = None
    lora: Optional[List[LoraScale]] = Field(default=None, description="Per-request LoRA scales: only the server's "
                                            "are served (a 400 for others).")

    def checked(self: Body) -> Body:
        """The body, or a 400 for a field this server cannot answer as llama-server does."""
        if self.n_probs > MAX_LOGPROBS:  # each token would carry that many alternatives
            raise RequestError(400, f"n_probs: at most {MAX_LOGPROBS} probabilities per token", param="n_probs")
        if self.n_probs and self.post_sampling_probs:
            raise RequestError(400, "post_sampling_probs: the probabilities served here are the model's, before "
                               "sampling (top_k, top_p, min_p, temperature); send it false",
                               param="post_sampling_probs")
        return self

    def completion(self, prompt: list[int] | list[list[int]], **more: Any) -> CompletionRequest:
        """The request as /v1/completions of the prompt's tokens (and `more` of its fields)."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in (
            "model", "temperature", "top_k", "top_p", "min_p", "typical_p", "stop", "repeat_penalty",
            "presence_penalty", "frequency_penalty", "grammar", "ignore_eos", "stream", "lora",
            *LlamaServerFields.model_fields)}
        fields["seed"] = None if self.seed is None or self.seed == -1 else self.seed
        fields["max_tokens"] = None if self.n_predict is None or self.n_predict < 0 else self.n_predict
        fields["logprobs"] = self.n_probs or None
        return CompletionRequest(prompt=prompt, **fields, **more)

    def settings(self) -> dict[str, Any]:
        """llama-server's `generation_settings`: the fields of this request that we apply."""
        names = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                 "frequency_penalty", "stop", "n_probs", "post_sampling_probs", "grammar", "ignore_eos", "stream",
                 *LlamaServerFields.model_fields)
        return {"n_predict": -1 if self.n_predict is None else self.n_predict,
                "seed": -1 if self.seed is None else self.seed, **{name: getattr(self, name) for name in names}}


class PromptObject(BaseModel):
    """llama-server's multimodal prompt item: text, and media this route does not take here."""

    prompt_string: str
    multimodal_data: Optional[List[str]] = None


PromptItem = Union[StrictInt, str, List[Union[StrictInt, str]], PromptObject]


BiasValue = Union[StrictBool, float]  # false: never (llama-server's -inf; -100 here, OpenAI's ban); true: ignored
Bias = Union[List[Tuple[Union[StrictInt, str], BiasValue]], Dict[str, BiasValue]]


class NativeCompletionRequest(NativeSampling):
    prompt: Union[str, PromptObject, List[PromptItem]] = Field(
        description="Text, token ids, texts and ids mixed, or a list of such prompts (one answer each).")
    return_tokens: bool = Field(default=False, description="Send the answer's token ids in `tokens`.")
    logit_bias: Optional[Bias] = Field(default=None, description="[[token id or text, bias], ...] or {id or text: "
                                       "bias}: a text's tokens each get its bias (-100..100).")


class NativeChoice(CompletionChoice):
    """A completion's choice that also keeps its token ids (llama-server's `tokens`, where
    return_tokens asks) and their probabilities (`completion_probabilities`, where n_probs asks)."""

    def __init__(self, index: int, piece: Piece, ids: bool, probs: bool) -> None:
        super().__init__(index, piece, "", False)  # OpenAI's logprobs off: these are llama-server's
        self.piece, self.keep_ids, self.keep_probs = piece, ids, probs
        self.ids: list[int] = []
        self.probs: list[dict[str, Any]] = []

    def add(self, text: str, outputs: list[TokenOutput]) -> None:
        super().add(text, outputs)
        taken = [one for output in outputs for one in output.unrolled()]
        self.ids += [one.token for one in taken] if self.keep_ids else []
        self.probs += native_probs(self.piece, taken) if self.keep_probs else []

    def final(self, finish: str) -> dict:
        body = super().final(finish)
        if self.keep_ids:
            body["tokens"] = self.ids
        if self.keep_probs:
            body["completion_probabilities"] = self.probs
        return body


def native_probs(piece: Piece, taken: list[TokenOutput]) -> list[dict[str, Any]]:
    """llama-server's completion_probabilities of tokens taken one by one: the chat logprobs' entries
    (token, logprob, bytes, top_logprobs) with each token's id."""
    return chat_logprobs(piece, taken, ids=True)
