"""llama-server's /tokenize and /detokenize bodies (tools/server/server-context.cpp, post_tokenize,
post_detokenize), for clients that count or cut prompts with them."""
from __future__ import annotations

from typing import List, Optional, Union

from pydantic import BaseModel, Field, StrictInt

from .native import Mixed


class NativeTokenize(BaseModel):
    model: Optional[str] = None
    content: Mixed = Field(description="Text, or texts and token ids mixed.")
    add_special: bool = Field(default=False, description="Add the model's BOS token (where it has one).")
    parse_special: bool = Field(default=True, description="Read control tokens spelled in the text as tokens.")
    with_pieces: bool = Field(default=False, description="Each token as {id, piece} (a piece not UTF-8: its bytes).")


class NativeDetokenize(BaseModel):
    model: Optional[str] = None
    tokens: List[StrictInt] = Field(default=[], description="Token ids of the model's vocabulary.")


Piece = Union[str, List[int]]
