"""The request fields of the peers' APIs that stock llama_cpp has no name for: llama-server's samplers
(DRY, XTC, top-n-sigma, dynamic temperature) and its `json_schema`, vLLM's `stop_token_ids`,
`repetition_penalty`, guided decoding (`guided_*`, `structured_outputs`) and
`include_stop_str_in_output`. Each is applied, by llama.cpp's own samplers and the server's
constraint engines; vLLM's fields that ask for what is not served here (beam search, the prompt's
log-probabilities, ...) are a 400. None is accepted and ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, Field, StrictInt, field_validator, model_validator

from ...llama import Dry, DynaTemp, Xtc
from .request_error import RequestError

Finite = Annotated[float, Field(allow_inf_nan=False)]  # JSON as Python reads it allows NaN and Infinity
MAX_DRY_WINDOW = 1 << 20  # llama.cpp allocates the window up front: INT32_MAX would be 8 GB
MAX_DRY_BREAKERS = 32
MAX_BREAKER_CHARS = 40  # llama.cpp's own cut (MAX_CHAR_LEN)
MAX_STOP_TOKEN_IDS = 256


class LlamaServerFields(BaseModel):
    """llama-server's fields (tools/server/server-schema.cpp), its defaults and rules."""

    dry_multiplier: Finite = Field(default=0.0, ge=0.0, description="DRY penalty's multiplier (0: off).")
    dry_base: Finite = Field(default=Dry.base, description=f"DRY's base (below 1: {Dry.base}, as llama-server).")
    dry_allowed_length: int = Field(default=2, ge=0, description="Repeats longer than this are penalized.")
    dry_penalty_last_n: int = Field(default=64, ge=0, le=MAX_DRY_WINDOW,
                                    description="Tokens DRY scans, the prompt's included (0: off).")
    dry_sequence_breakers: List[str] = Field(default=["\n", ":", "\"", "*"], min_length=1,
                                             max_length=MAX_DRY_BREAKERS)
    xtc_probability: Finite = Field(default=0.0, ge=0.0, le=1.0, description="XTC's chance a step (0: off).")
    xtc_threshold: Finite = Field(default=0.1, ge=0.0, description="XTC's floor (above 0.5: off).")
    top_n_sigma: Finite = Field(default=-1.0, description="Keep logits within n standard deviations of "
                               "the best (<= 0: off).")
    dynatemp_range: Finite = Field(default=0.0, ge=0.0, description="Dynamic temperature's range (0: off).")
    dynatemp_exponent: Finite = Field(default=1.0)
    json_schema: Optional[Dict[str, Any]] = Field(default=None, description="The output follows this JSON schema "
                                                  "({}: any object), as llama-server's field.")

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _breakers_fit(cls, breakers: List[str]) -> List[str]:
        for i, breaker in enumerate(breakers):
            if not 0 < len(breaker) <= MAX_BREAKER_CHARS:
                raise RequestError(400, f"dry_sequence_breakers.{i}: 1 to {MAX_BREAKER_CHARS} characters "
                                   f"({len(breaker)} given)", param=f"dry_sequence_breakers.{i}")
        return breakers

    def peer_samplers(self) -> dict[str, Any]:
        """The SamplerParams fields of these samplers, None where llama.cpp would leave one out."""
        dry = Dry(self.dry_multiplier, self.dry_base if self.dry_base >= 1.0 else Dry.base, self.dry_allowed_length,
                  self.dry_penalty_last_n, tuple(self.dry_sequence_breakers))
        return {"dry": dry if self.dry_multiplier > 0 and self.dry_penalty_last_n > 0 else None,
                "xtc": Xtc(self.xtc_probability, self.xtc_threshold)
                if self.xtc_probability > 0 and self.xtc_threshold <= 0.5 else None,
                "top_n_sigma": self.top_n_sigma if self.top_n_sigma > 0 else None,
                "dynatemp": DynaTemp(self.dynatemp_range, self.dynatemp_exponent) if self.dynatemp_range > 0 else None}


Schema = Union[Dict[str, Any], str]  # vLLM takes a schema as an object or as its JSON text


class StructuredOutputs(BaseModel):
    """vLLM's current form of guided decoding (one of the fields)."""

    json_: Optional[Schema] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class VllmFields(BaseModel):
    """vLLM's sampling fields (vllm/entrypoints/openai/protocol.py)."""

    stop_token_ids: Optional[List[StrictInt]] = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS, description="A generated token among these ends the answer "
        "(finish_reason stop, its text kept), once min_tokens are out.")
    repetition_penalty: Optional[Finite] = Field(
        default=None, gt=0.0, description="vLLM's name for repeat_penalty (over the server's penalty "
        "window, not the whole prompt as vLLM's).")
    guided_json: Optional[Schema] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = Field(default=None, min_length=1)
    guided_grammar: Optional[str] = Field(default=None, description="A GBNF grammar, as `grammar`.")
    structured_outputs: Optional[StructuredOutputs] = None
    include_stop_str_in_output: bool = Field(default=False, description="The stop string that ended the text "
                                             "stays at its end.")
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1, description="A prompt longer than this is "
                                                  "a 400 (vLLM cuts it from the left; -1: the context's length).")
    # vLLM's fields this server does not serve: accepted where they ask for nothing, else a 400 (_UNSERVED)
    use_beam_search: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None

    @model_validator(mode="after")
    def _refuse_unserved(self) -> VllmFields:
        for name, (neutral, why) in _UNSERVED.items():
            if getattr(self, name) != neutral:
                raise RequestError(400, f"{name}: {why}", param=name)
        best_of = getattr(self, "best_of", None)  # OpenAI's legacy completions field (stock's type has it)
        if best_of is not None and best_of > (getattr(self, "n", None) or 1):
            raise RequestError(400, "best_of: choosing the best of more samples than n is not served here; "
                               "send n and choose on the client", param="best_of")
        return self


_UNSERVED: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not served here (sampling only)"),
    "skip_special_tokens": (True, "special tokens' text is not written into answers here"),
    "prompt_logprobs": (None, "the prompt's log-probabilities are not served here"),
    "allowed_token_ids": (None, "not served here: a grammar (guided_grammar) or logit_bias constrains the tokens"),
    "bad_words": (None, "not served here: logit_bias bans a word's tokens"),
}


Kind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class Guide:
    """One request's guided decoding, by the field the client named."""

    kind: Kind
    value: Any  # a JSON schema (None: any JSON value), a regex, the choices, a GBNF grammar
    param: str


_KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar")


def asks_guide(body: BaseModel) -> bool:
    """Whether any peer's field names a guide (checked and parsed by `guide_of`, where it is prepared)."""
    return any(guide.value is not None for guide in _guides(body))


def guide_of(body: BaseModel) -> Guide | None:
    """The request's guided decoding, from whichever peer's field names it; two are a 400."""
    given = [guide for guide in _guides(body) if guide.value is not None]
    if len(given) > 1:
        raise RequestError(400, f"{given[0].param} and {given[1].param} both constrain the output: send one",
                           param=given[1].param)
    if not given:
        return None
    guide = given[0]
    if guide.param == "structured_outputs.json_object":
        return Guide("json", None, guide.param)  # any JSON value
    if guide.param == "json_schema":
        return Guide("json", guide.value or {"type": "object"}, guide.param)  # llama-server: {} is any object
    return Guide(guide.kind, _schema(guide.value, guide.param), guide.param) if guide.kind == "json" else guide


def _guides(body: BaseModel) -> list[Guide]:
    """Each field that may name a guide, set or not (value None)."""
    fields = [Guide("json", getattr(body, "json_schema", None), "json_schema")]
    fields += [Guide(kind, getattr(body, f"guided_{kind}", None), f"guided_{kind}") for kind in _KINDS]
    outputs = getattr(body, "structured_outputs", None)
    if outputs is not None:
        fields += [Guide(kind, getattr(outputs, "json_" if kind == "json" else kind), f"structured_outputs.{kind}")
                   for kind in _KINDS]
        fields.append(Guide("json", True if outputs.json_object else None, "structured_outputs.json_object"))
    return fields


def _schema(value: Schema, param: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as error:
        raise RequestError(400, f"{param}: not a JSON schema ({error})", param=param) from None
