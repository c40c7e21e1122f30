"""A large request's preparation waits while another request's first token is a step away
(server/runtime/polite.py), a bounded wait, and not at all otherwise."""
from __future__ import annotations

import asyncio
import time

from pflash_plugin.engine.seams import Activity
from pflash_plugin.engine.step_policy import Flags
from pflash_plugin.server.runtime.polite import after_first_tokens


def _waited(activity: Activity, bound_s: float, clear_after_s: float | None = None) -> float:
    async def run() -> float:
        if clear_after_s is not None:
            asyncio.get_running_loop().call_later(clear_after_s, activity.publish, Flags())
        start = time.perf_counter()
        await after_first_tokens(activity, bound_s)
        return time.perf_counter() - start
    return asyncio.run(run())


def test_preparation_waits_for_a_first_token_a_step_away_and_no_longer_than_its_bound():
    activity = Activity()
    assert _waited(activity, 2.0) < 0.25  # nothing imminent: no wait
    activity.publish(Flags(interactive_waiting=True))  # a long prompt's first token, seconds away: no wait
    assert _waited(activity, 2.0) < 0.25
    activity.publish(Flags(interactive_waiting=True, first_token_next=True))
    assert 0.3 <= _waited(activity, 2.0, clear_after_s=0.3) < 1.5  # until the first token's step is done
    activity.publish(Flags(interactive_waiting=True, first_token_next=True))
    assert 0.3 <= _waited(activity, 0.3) < 1.5  # a step that takes long: the bound


def test_a_large_request_waits_over_http_and_a_short_one_does_not(tiny_server):
    ctx = tiny_server.app.state.pflash
    activity = ctx.models.get(None).engine.activity
    activity.first_token_next = lambda: True  # as if another request's first token were always a step away
    before, ctx.settings.polite_prepare_ms = ctx.settings.polite_prepare_ms, 600.0  # the shared server's: put back
    try:
        with tiny_server.client() as client:
            def took(body: dict) -> float:
                start = time.perf_counter()
                reply = client.post("/v1/completions", json={"max_tokens": 1, **body})
                assert reply.status_code == 200, reply.text
                return time.perf_counter() - start
            short = took({"prompt": "hi"})
            large = took({"prompt": list(range(5, 305)), "n": 2})  # n > 1: prepared on a worker thread
            ctx.settings.polite_prepare_ms = 0.0
            off = took({"prompt": list(range(5, 305)), "n": 2})
    finally:
        del activity.first_token_next
        ctx.settings.polite_prepare_ms = before
    assert short < 0.5 and large >= 0.6 and off < 0.5
