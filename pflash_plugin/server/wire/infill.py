"""llama-server's POST /infill body (tools/server/server-context.cpp, post_infill; its README), so
that code editors' plugins made for it (llama.vim, llama.vscode) complete code here; and its
sampling fields (native.py) as a completions request, which the engine runs as any other."""
from __future__ import annotations

from typing import List

from pydantic import BaseModel, Field

from ...engine.line_limits import LineLimits
from .native import Mixed, NativeSampling


class ExtraChunk(BaseModel):
    """A file of the repo-level context (input_extra)."""

    text: str
    filename: str = "tmp"  # llama-server's default


class InfillRequest(NativeSampling):
    input_prefix: Mixed = Field(description="The code before the cursor (its last lines).")
    input_suffix: Mixed = Field(description="The code after the cursor.")
    input_extra: List[ExtraChunk] = Field(default=[], description="Other files' text, read before the prefix.")
    prompt: str = Field(default="", description="The cursor's line up to the cursor: read after the prefix.")
    n_indent: int = Field(default=0, ge=0, description="Lines after the first indented at least this much, else "
                          "the answer ends before the line's first character.")
    t_max_predict_ms: int = Field(default=-1, ge=-1, description="Past this long since the first token, a newline "
                                  "ends the answer (<= 0: no limit).")

    def line_limits(self) -> LineLimits:
        """The editor's stop rules on lines (engine/line_limits.py)."""
        return LineLimits(self.n_indent, float(max(self.t_max_predict_ms, 0)))
