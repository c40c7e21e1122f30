"""llama-server's POST /infill body (tools/server/server-context.cpp, post_infill; its README), so
that code editors' plugins made for it (llama.vim, llama.vscode) complete code here; and its
sampling fields as a completions request, which the engine runs as any other."""
from __future__ import annotations

from typing import Any, List, Optional, Union

from pydantic import AliasChoices, BaseModel, Field, StrictInt

from ...engine.line_limits import LineLimits
from .protocol import CompletionRequest, RequestError

Mixed = Union[str, List[Union[StrictInt, str]]]  # text, or texts and token ids (llama-server's tokenize_mixed)


class ExtraChunk(BaseModel):
    """A file of the repo-level context (input_extra)."""

    text: str
    filename: str = "tmp"  # llama-server's default


class InfillRequest(BaseModel):
    model: Optional[str] = None
    input_prefix: Mixed = Field(description="The code before the cursor (its last lines).")
    input_suffix: Mixed = Field(description="The code after the cursor.")
    input_extra: List[ExtraChunk] = Field(default=[], description="Other files' text, read before the prefix.")
    prompt: str = Field(default="", description="The cursor's line up to the cursor: read after the prefix.")
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
    stream: bool = False
    n_probs: int = Field(default=0, ge=0)
    response_fields: Optional[List[str]] = Field(
        default=None, description="The answer's fields to send; 'a/b' sends a's b as 'a/b'.")
    n_indent: int = Field(default=0, ge=0, description="Lines after the first indented at least this much, else "
                          "the answer ends before the line's first character.")
    t_max_predict_ms: int = Field(default=-1, ge=-1, description="Past this long since the first token, a newline "
                                  "ends the answer (<= 0: no limit).")
    # accepted and not applied (docs/api.md): the prefix cache always reuses, the engine picks slots,
    # llama-server itself ignores t_max_prompt_ms; the sampler chain's order is the server's
    cache_prompt: bool = True
    id_slot: int = -1
    t_max_prompt_ms: int = -1
    samplers: Optional[List[str]] = None

    def checked(self) -> InfillRequest:
        """The body, or a 400 for a field this server cannot answer as llama-server does."""
        if self.n_probs:
            raise RequestError(400, "n_probs: /infill does not return token probabilities here; /v1/completions "
                               "with a suffix and logprobs does", param="n_probs")
        return self

    def completion(self, tokens: list[int]) -> CompletionRequest:
        """The request as /v1/completions of the FIM prompt's `tokens`."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in (
            "model", "temperature", "top_k", "top_p", "min_p", "typical_p", "stop", "repeat_penalty",
            "presence_penalty", "frequency_penalty", "grammar", "stream")}
        fields["seed"] = None if self.seed is None or self.seed == -1 else self.seed
        fields["max_tokens"] = None if self.n_predict is None or self.n_predict < 0 else self.n_predict
        return CompletionRequest(prompt=tokens, **fields)

    def line_limits(self) -> LineLimits:
        """The editor's stop rules on lines (engine/line_limits.py)."""
        return LineLimits(self.n_indent, float(max(self.t_max_predict_ms, 0)))
