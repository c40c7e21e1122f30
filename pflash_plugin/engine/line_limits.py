"""Code editors' stop rules on lines, as llama-server applies them (server-context.cpp,
process_token): `n_indent`, every line after the first must be indented at least that much, else
the text ends before its first character (a completion that dedents has left the block being
written); `t_max_ms`, past that long since the first token a released newline ends the text (a
suggestion of whole lines, in time). llama.vim and llama.vscode send both with each /infill.
The text ends as at max_tokens (finish reason length: llama-server's stop_type limit)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LineLimits:
    n_indent: int = 0  # 0: any indentation
    t_max_ms: float = 0.0  # 0: no time limit

    def __bool__(self) -> bool:
        return self.n_indent > 0 or self.t_max_ms > 0


class LineRule:
    """One request's text under its limits, fed as it is released."""

    def __init__(self, limits: LineLimits) -> None:
        self.limits = limits
        self.indent: int | None = None  # None: on the first line; else the current line's indentation so far
        self.checked = False  # the current line reached its first character and passed
        self.ended = False

    def feed(self, text: str, elapsed_ms: float) -> str:
        """What of `text` goes out; `ended` once a limit ended the text (the rest is dropped)."""
        if self.ended:
            return ""
        kept = self._indented(text) if self.limits.n_indent > 0 else text
        if not self.ended and self.limits.t_max_ms > 0 and "\n" in kept and elapsed_ms > self.limits.t_max_ms:
            self.ended = True
        return kept

    def _indented(self, text: str) -> str:
        """`text` up to the first character (or end, as llama-server reads an empty line) of a
        line after the first that is indented less than n_indent."""
        for at, char in enumerate(text):
            if self.indent is None or self.checked:
                if char == "\n":
                    self.indent, self.checked = 0, False
            elif char in " \t":
                self.indent += 1
            elif self.indent < self.limits.n_indent:
                self.ended = True
                return text[:at]
            elif char == "\n":
                self.indent = 0
            else:
                self.checked = True
        return text
