"""A request's sampled tokens taken in, one by one: the rules that end a generation as its tokens
arrive, apart from the scheduler's mechanism (which places the step's rows in their slots and owns
the lifecycle: `finish` and `fail` are its).

A row's outcome is a TokenOutput (after the drafts the target accepted, for a speculating row), a
RequestRefused (the client's: a grammar too costly to go on) or another exception (that request
fails). Its tokens are taken in order: the reasoning budget may put the closing tag in a token's
place; an end-of-generation token ends the request (stop) without being kept; a token that reaches
`max_tokens` ends it (length, or stop where the text it releases hits a stop string). The text
waits for `release` (on a GPU, beside the next decode), unless a request with stop strings took
several tokens in one step: a stop string among them ends it there, before the rest are kept.
A request's first token is `fresh` until released: on a GPU its text goes out before the next
launch, not beside it (stepping.py).
"""
from __future__ import annotations

from typing import Callable, Iterable

from .live_text import LiveText
from .request import ErrorEvent, ErrorKind, Request, RequestRefused, RequestStatus, TokenOutput

Finish = Callable[..., None]  # Scheduler.finish(request, status, error=None)
Fail = Callable[[Request, BaseException, str], None]  # Scheduler.fail(request, error, what)


class Intake:
    """Takes rows' outcomes into their requests (`take`) and releases their text (`release`);
    `is_eog` names end-of-generation tokens."""

    def __init__(self, text: LiveText, is_eog: Callable[[int], bool], finish: Finish, fail: Fail) -> None:
        self.text, self.is_eog, self.finish, self.fail = text, is_eog, finish, fail
        self.fresh: list[Request] = []  # their first token taken, its text not yet released

    def take(self, request: Request, out: TokenOutput | Exception | None, now: float) -> None:
        """One row's outcome (its logits were asked for) at time `now`."""
        if isinstance(out, RequestRefused):  # the client's (a grammar too costly to go on)
            self.finish(request, RequestStatus.FINISHED_REJECTED, ErrorEvent(ErrorKind.INVALID, str(out)))
            return
        if isinstance(out, Exception):
            self.fail(request, out, "sampling")
            return
        assert out is not None, f"no sampled token for request {request.request_id}"
        if request.timings.first_token is None:
            request.timings.first_token = now
            self.fresh.append(request)
        request.timings.last_token = now
        taken = out.unrolled() if out.accepted else (out,)  # a copy per token costs 1 µs a row
        for n, one in enumerate(taken, 1):
            if not self._one(request, one):
                return
            watched = request.params.stop or request.line_limits
            if n < len(taken) and watched and self.text.release(request):  # stops mid-run
                self.finish(request, self._ended_by_text(request))
                return

    def _one(self, request: Request, out: TokenOutput) -> bool:
        """One sampled token: end of generation, the reasoning budget, a stop token id (kept in the
        text, as vLLM keeps it), max_tokens; False: it ended."""
        if request.thinking is not None:  # past its reasoning budget, the closing tag in place of its token
            token = request.thinking.next_token(out.token, self.text.piece)
            out = out if token == out.token else TokenOutput(token)
        if self.is_eog(out.token):
            self.finish(request, RequestStatus.FINISHED_STOP)
            return False
        request.output_tokens.append(out.token)
        self.text.take(request, out)
        n, p = len(request.output_tokens), request.params
        stop_id = out.token in p.stop_token_ids and n >= p.min_tokens
        if stop_id or n >= p.max_tokens:
            stopped = self.text.release(request)
            self.finish(request, self._ended_by_text(request) if stopped
                        else RequestStatus.FINISHED_STOP if stop_id else RequestStatus.FINISHED_LENGTH)
            return False
        return True

    def _ended_by_text(self, request: Request) -> RequestStatus:
        """A stop string ends a request as stop; a line limit as length (llama-server's stop_type
        limit: the text was cut, not finished)."""
        return RequestStatus.FINISHED_LENGTH if self.text.limited(request) else RequestStatus.FINISHED_STOP

    def release(self, running: Iterable[Request], fresh_only: bool = False) -> None:
        """The text of the tokens taken since the last call, as events; a request whose text
        reaches a stop string finishes (stop). A failure there fails its request alone.
        `fresh_only`: only the requests whose first token is among them (those `running` holds)."""
        fresh, self.fresh = self.fresh, []
        if fresh_only:
            live = set(map(id, running))
            running = [r for r in fresh if id(r) in live]
        for request in [r for r in running if self.text.unread(r)]:
            try:
                if self.text.release(request):
                    self.finish(request, self._ended_by_text(request))
            except Exception as error:
                self.fail(request, error, "releasing its text")
