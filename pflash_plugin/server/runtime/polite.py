"""A large request's preparation waits, a step at most, while another request's first token comes
from the engine's next step. Parsing and preparing a prompt of 22K token ids is ~3 ms of Python and
C holding the GIL, wherever it runs; the engine thread, back from each GIL-free call of its step,
waits its turn for the GIL meanwhile. Beside four such bodies mix8's short requests' step of 4 x 32
tokens took 19-26 ms on an H100 where the weights take ~5 ms to read (docs/first_token_cpu.md); with
this wait, 13.8 ms against 15.6 (e134a6b); with the request path's threads kept (wire/offload.py), 14.6-17.4
ms against 22.6-35.0 and the client's TTFT 36.8-39.2 ms against 47.7-53.9 (855a6fd). A long prompt's own
first token is seconds away: a wait of one step costs it little, and under arrivals (the online benchmark,
e20e45d, 2 and 4 req/s) goodput was the same with it as without. 100 ms by default; 0 never waits."""
from __future__ import annotations

import asyncio

from ...engine.seams import Activity

POLL_S = 0.001


async def after_first_tokens(activity: Activity, bound_s: float) -> None:
    """Return once no request's first token is a step away (Activity.first_token_next), or after
    `bound_s` (0: at once)."""
    if bound_s <= 0:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while activity.first_token_next() and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
