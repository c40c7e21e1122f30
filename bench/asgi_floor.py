"""The floor of bench/first_token.py: the least an ASGI app on uvicorn does for its requests (read
the body, parse it, stream one text chunk and a usage chunk): the client's, the kernel's and
uvicorn's share of a TTFT on the same machine. `python -m uvicorn asgi_floor:app` from bench/."""
import json
from typing import Any, Awaitable, Callable

Message = dict[str, Any]


async def app(scope: Message, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]) -> None:
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/status":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"models": {"m": {"running": 0, "waiting": 0}}}'})
        return
    if scope["path"] == "/v1/models":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    json.loads(body)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    chunk = {"choices": [{"text": "x", "delta": {"content": "x"}}]}
    usage = {"choices": [], "usage": {"timings": {"ttft_ms": 0.0}}}
    for c in (chunk, usage):
        await send({"type": "http.response.body", "body": f"data: {json.dumps(c)}\n\n".encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
