"""The text of the requests that hold slots: the tokens taken, pushed through each request's text
stream (stop strings, incomplete UTF-8 held back) into TextEvents in the outbox."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .line_limits import LineRule
from .outbox import Outbox
from .request import Request, TextEvent, TokenOutput
from .text_stream import TextStream


@dataclass
class _Live:
    """What the scheduler keeps for a request while it holds a slot."""

    stream: TextStream
    unread: list[TokenOutput] = field(default_factory=list)  # taken, not yet through the text stream
    pending: list[TokenOutput] = field(default_factory=list)  # through the stream, their text held back
    starved: int = 0  # steps it was left out of while prefilling (aging)
    lines: LineRule | None = None  # an editor's line limits (line_limits.py), where the request has them

    @property
    def ended(self) -> bool:
        """A stop string or a line limit ended the text."""
        return self.stream.stopped or (self.lines is not None and self.lines.ended)

    def limited(self, text: str, first_token: float | None) -> str:
        """`text` as the line limits let it out (all of it where there are none)."""
        if self.lines is None or not text:
            return text
        return self.lines.feed(text, 0.0 if first_token is None else (time.perf_counter() - first_token) * 1000.0)


class LiveText:
    """One `_Live` per request holding a slot, from `start` to `close`."""

    def __init__(self, piece: Callable[[int], bytes], outbox: Outbox) -> None:
        self.piece, self.outbox = piece, outbox
        self._live: dict[int, _Live] = {}

    def start(self, request: Request) -> None:
        limits = request.line_limits
        self._live[request.request_id] = _Live(TextStream(request.params.stop, request.params.kept_stops),
                                               lines=LineRule(limits) if limits else None)

    def starved(self, request: Request) -> int:
        """Steps the request was left out of while prefilling."""
        return self._live[request.request_id].starved

    def left_out(self, request: Request) -> None:
        self._live[request.request_id].starved += 1

    def take(self, request: Request, out: TokenOutput) -> None:
        """A sampled token, its text released later (`release`)."""
        self._live[request.request_id].unread.append(out)

    def unread(self, request: Request) -> bool:
        return bool(self._live[request.request_id].unread)

    def release(self, request: Request) -> bool:
        """Push the request's unread tokens through its text stream; True once a stop string hit
        or a line limit ended the text (`limited` tells which)."""
        live = self._live[request.request_id]
        for out in live.unread:
            live.pending.append(out)
            text = live.limited(live.stream.push(self.piece(out.token)), request.timings.first_token)
            if text:
                self.outbox.push(request, TextEvent(text, live.pending[:]))
                live.pending.clear()
            if live.ended:
                break
        live.unread.clear()
        return live.ended

    def limited(self, request: Request) -> bool:
        """Whether a line limit (not a stop string) ended the request's text."""
        lines = self._live[request.request_id].lines
        return lines is not None and lines.ended

    def close(self, request: Request, clean: bool) -> str | None:
        """Forget the request's stream, its held-back text going out where it ended `clean` (stop,
        length, cancelled) and no stop string cut it; the stop string hit, if any."""
        live = self._live.pop(request.request_id)
        if clean and not live.ended:
            tail = live.limited(live.stream.flush(), request.timings.first_token)
            if tail:
                self.outbox.push(request, TextEvent(tail, live.pending))
        return live.stream.stop_hit
