"""The one place where engine events become an HTTP answer: a JSON body or an SSE stream, for one
choice or n of them, and where a client that leaves cancels what it asked for. The engine thread
admits or refuses a client's n requests together before the answer starts, so a refusal is an
error response, never a 200 stream that ends in an error.

Cancellation owns three cases: a non-streamed request whose client disconnects (watched while it
decodes), a stream that ends or breaks, and a stream whose client left before the SSE generator
ever started (the generator's own `finally` would never run, so the response object cancels).
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import Request
from sse_starlette.sse import EventSourceResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ...engine.request import ErrorEvent, Event, FinishEvent, TextEvent, Timings, Usage
from ...engine.request import Request as EngineRequest
from ..operations.received import body_read, received
from ..runtime.context import ServerContext
from ..runtime.generation import Generation
from ..wire.errors import client_event, http_of
from ..wire.protocol import RequestError
from ..wire.usage import Totals, totals
from .presenters import ChatPresenter, Presenter, Sse

_GONE = object()  # queued when the client of a non-streamed request disconnects


class _Mailbox:
    """Events from the engine thread to one event loop, handed over once per step: the sinks stage
    a step's events (one per running request) and the step's flush wakes the loop once for all of
    them. A wake-up per token cost the engine thread a socket write and a wait for the GIL each."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)  # weak: the mailbox is the value of a weak map keyed by its loop
        self.pending: list[tuple[asyncio.Queue, Any]] = []
        self.scheduled = False  # a hand-over is queued on the loop and has not run yet
        self.lock = threading.Lock()

    def stage(self, queue: asyncio.Queue, item: Any) -> None:  # on the engine thread
        with self.lock:
            self.pending.append((queue, item))

    def wake(self) -> None:  # on the engine thread, after a step's events
        with self.lock:
            if self.scheduled or not self.pending:
                return
            self.scheduled = True
        try:
            loop = self.loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop is closed or gone: nothing will read these
            with self.lock:
                self.pending.clear()
                self.scheduled = False
            raise

    def _hand_over(self) -> None:  # on the loop
        with self.lock:
            pending, self.pending, self.scheduled = self.pending, [], False
        for queue, item in pending:
            queue.put_nowait(item)


_mailboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox]" = weakref.WeakKeyDictionary()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = _Mailbox(loop)
    return box


async def respond(http: Request, ctx: ServerContext, gen: Generation, stream: bool,
                  presenter: Presenter | None = None) -> Response | dict | list[dict]:
    """Submit the generation's requests and answer with their output in the presenter's shapes
    (OpenAI chat or completions by default): an SSE response, or the whole body (a dict the route
    validates against its response model), or an error response."""
    shown = presenter or ChatPresenter(gen)
    http.state.presenter = shown  # what shapes the answer if the server's shutdown cuts it (shutdown_cut.py)
    mailbox = _mailbox(asyncio.get_running_loop())
    events: asyncio.Queue = asyncio.Queue()
    gen.clock = ctx.settings.usage_clock
    for index, request in enumerate(gen.requests):
        request.timings.received, request.timings.body_read = received(http), body_read(http)
        def sink(event: Event, i: int = index) -> None:  # on the engine thread
            if isinstance(event, (FinishEvent, ErrorEvent)):  # counted whether or not the client still listens
                _count(ctx, gen, event)
            if isinstance(event, FinishEvent) and event.reason == "cancelled" and i not in gen.done:
                ctx.metrics.cut_at_shutdown.labels("engine").inc()  # the engine cut it: the HTTP side did not
            elif isinstance(event, TextEvent) and gen.requests[i].timings.first_released is None:
                gen.requests[i].timings.first_released = time.perf_counter()  # usage's timings.release_ms
            mailbox.stage(events, (i, client_event(event)))

        request.sink, request.flush = sink, mailbox.wake
    try:
        await ctx.submit(gen.served, gen.requests, "messages" if gen.object == "chat.completion" else "prompt")
    except RequestError:
        gen.done.update(range(len(gen.requests)))  # refused, all of them: nothing to cancel
        raise
    except BaseException:
        gen.cancel_unfinished()  # the client left while the engine was answering
        raise
    if stream:
        ping = 10**9 if ctx.settings.disable_ping_events else ctx.settings.sse_ping_seconds
        # comment pings keep the stream alive while a prompt waits or is compressed
        return _CancellingStream(_publish(gen, shown, events), gen, ping=ping, sep="\n")
    try:
        return await _collect(http, gen, shown, events)
    finally:
        gen.cancel_unfinished()


def _count(ctx: ServerContext, gen: Generation, event: FinishEvent | ErrorEvent) -> None:
    """A request's end in the metrics: a cancelled one (its client gone) too, with its tokens; the
    compression its n choices share, with the first of them (on the engine thread, as every sink)."""
    model = gen.served.name
    if isinstance(event, FinishEvent):
        report = None if gen.compression_counted else event.usage.pflash
        gen.compression_counted |= report is not None
        ctx.metrics.finished(model, event.reason, event.usage, report)
    else:
        ctx.metrics.errors.labels(model, str(http_of(event.kind).status)).inc()


def _usage(gen: Generation, usages: dict[int, Usage]) -> Totals:
    return totals([_marked(usages[i], gen.requests[i].timings, gen.clock) for i in sorted(usages)],
                  gen.prompt_tokens)


def _marked(usage: Usage, marks: Timings, clock: bool) -> Usage:
    """The usage with release_ms and emit_ms as the event loop knows them at the answer's end: the
    engine thread built it at the request's finish, maybe before its first text left the engine or
    reached the client (then the two read 0); with the marks themselves where `clock`."""
    latency = marks.latency()
    return replace(usage, latency=replace(usage.latency, release_ms=latency.release_ms, emit_ms=latency.emit_ms),
                   clock=marks.clock() if clock else None)


async def _collect(http: Request, gen: Generation, shown: Presenter,
                   events: asyncio.Queue) -> Response | dict | list[dict]:
    watcher = asyncio.ensure_future(_put_on_disconnect(http, events))
    ends: dict[int, FinishEvent] = {}
    finals: dict[int, dict] = {}
    try:
        while len(ends) < len(gen.requests):
            index, event = await events.get()
            if event is _GONE:
                return Response(status_code=499)
            choice = gen.choices[index]
            if isinstance(event, TextEvent):
                choice.add(event.text, event.tokens)
            elif isinstance(event, FinishEvent):
                gen.done.add(index)
                ends[index], finals[index] = event, choice.final(event.reason)
            elif isinstance(event, ErrorEvent):
                gen.done.add(index)
                return shown.error(event)
    finally:
        watcher.cancel()
    order = sorted(finals)
    return shown.body([finals[i] for i in order], [ends[i] for i in order],
                      _usage(gen, {i: end.usage for i, end in ends.items()}))


async def client_gone(http: Request) -> None:
    """Returns once the client disconnects (the body is read: the next ASGI message says so)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _put_on_disconnect(http: Request, events: asyncio.Queue) -> None:
    await client_gone(http)
    events.put_nowait((None, _GONE))


async def _publish(gen: Generation, shown: Presenter, events: asyncio.Queue) -> AsyncIterator[Sse]:
    for item in shown.head():
        yield item
    usages: dict[int, Usage] = {}
    while len(usages) < len(gen.requests):
        index, event = await events.get()
        if isinstance(event, TextEvent):
            items = shown.delta(index, event)
        elif isinstance(event, FinishEvent):
            gen.done.add(index)
            usages[index] = event.usage
            items = shown.finish(index, event)
        elif isinstance(event, ErrorEvent):
            gen.done.add(index)
            for item in shown.stream_error(event):
                yield item
            return
        for item in items:
            yield item
        if isinstance(event, TextEvent) and items:
            _written(gen.requests[index])
    for item in shown.done(_usage(gen, usages)):
        yield item


def _written(request: EngineRequest) -> None:
    """Mark when a request's first text was handed to the client's socket (the SSE response sent
    the items the generator yielded before it resumed): usage's timings.emit_ms counts to it from
    the event's release."""
    if request.timings.first_written is None:
        request.timings.first_written = time.perf_counter()


class _CancellingStream(EventSourceResponse):
    """An SSE response that cancels its unfinished engine requests when it ends, however it ends:
    finished, broken, or never started because the client left first."""

    def __init__(self, content: AsyncIterator[dict], gen: Generation, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.cancel_unfinished()
