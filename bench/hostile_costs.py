"""Issue 49's hostile costs, measured as a client sees them, against a running server:

    python -m pflash_plugin.server --n_ctx 16384 --max_concurrency 4 --pflash auto --port 8000 &
    python bench/hostile_costs.py --url http://127.0.0.1:8000

Each case prints its status and seconds: 200K Anthropic tool_result blocks on count_tokens, 235K
tool messages on chat, four 7 MB pflash.query at once, chat max_tokens -1, and a short chat's
latency quiet and beside a flood of token counting (8 clients counting 126K-character texts)."""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx


def timed(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, float, str]:
    """Status, seconds and the answer's start, for a body sent as compact JSON."""
    content = json.dumps(body, separators=(",", ":"))
    started = time.perf_counter()
    reply = client.post(path, content=content, headers={"content-type": "application/json"})
    return reply.status_code, time.perf_counter() - started, reply.text[:160]


def tool_results(client: httpx.Client, n: int = 200_000) -> None:
    blocks = [{"type": "tool_result", "tool_use_id": "t"} for _ in range(n)]  # 8.2 MB as issue 49's
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    body = {"model": "x", "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": [use]},
                                       {"role": "user", "content": blocks}]}
    print(f"count_tokens, {n:,} tool_result blocks: %d in %.2f s  %s" % timed(client, "/v1/messages/count_tokens", body))


def tool_messages(client: httpx.Client, n: int = 235_000) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                *({"role": "tool", "tool_call_id": "c"} for _ in range(n))]  # 8.2 MB
    body = {"messages": messages, "max_tokens": 4}
    print(f"chat, {n:,} tool messages: %d in %.2f s  %s" % timed(client, "/v1/chat/completions", body))


def big_queries(client: httpx.Client, mb: int = 7, clients: int = 4) -> None:
    body = {"messages": [{"role": "user", "content": "Summarize: " + "the bridge opens at dawn. " * 400}],
            "max_tokens": 4, "pflash": {"mode": "always", "query": "q" * (mb * 10**6)}}
    with ThreadPoolExecutor(clients) as pool:
        for status, took, text in pool.map(lambda _: timed(client, "/v1/chat/completions", body), range(clients)):
            print(f"{clients} x {mb} MB pflash.query: {status} in {took:.2f} s  {text}")


def negative_max_tokens(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}
    print("chat max_tokens -1: %d in %.2f s  %s" % timed(client, "/v1/chat/completions", body))


def short_chats(client: httpx.Client, n: int) -> list[float]:
    body = {"messages": [{"role": "user", "content": "Name two colors."}], "max_tokens": 8, "temperature": 0}
    return [timed(client, "/v1/chat/completions", body)[1] for _ in range(n)]


def count_flood(url: str, clients: int = 8, chars: int = 126_000) -> None:
    """Short chats quiet, then beside `clients` clients counting `chars`-character texts without pause."""
    quiet = short_chats(httpx.Client(base_url=url, timeout=300), 5)
    stop, statuses = threading.Event(), {}
    text = "the bridge opens at dawn, " * (chars // 26)

    def flood() -> None:
        with httpx.Client(base_url=url, timeout=300) as mine:
            while not stop.is_set():
                body = {"model": "x", "messages": [{"role": "user", "content": text}]}
                code = mine.post("/v1/messages/count_tokens", json=body).status_code
                statuses[code] = statuses.get(code, 0) + 1

    threads = [threading.Thread(target=flood) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(2)
    loaded = short_chats(httpx.Client(base_url=url, timeout=300), 5)
    stop.set()
    for thread in threads:
        thread.join()
    print(f"short chat quiet: median {statistics.median(quiet):.2f} s, max {max(quiet):.2f} s; beside {clients} "
          f"clients counting {chars:,} characters: median {statistics.median(loaded):.2f} s, max {max(loaded):.2f} s "
          f"({statistics.median(loaded) / statistics.median(quiet):.1f}x); the flood's answers: {statuses}")


CASES = {"tool_results": tool_results, "tool_messages": tool_messages, "queries": big_queries,
         "max_tokens": negative_max_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--cases", nargs="*", default=[*CASES, "flood"])
    args = parser.parse_args()
    with httpx.Client(base_url=args.url, timeout=600) as client:
        for name in args.cases:
            if name == "flood":
                count_flood(args.url)
            else:
                CASES[name](client)


if __name__ == "__main__":
    main()
