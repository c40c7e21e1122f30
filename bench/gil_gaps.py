"""Does anything in the server hold the GIL for long? A server with a probe thread that sleeps 1 ms
and logs every wake-up later than `--min-ms`, sent one request of each kind once it is ready.

A native call that holds the GIL freezes the HTTP loop and the engine thread alike: llguidance's
tokenizer of a 262K vocabulary, built after the server said it was ready, froze it for 2.9 s
(session 73; now built before). Gaps before ready cost only the start; gaps after it are what to
look into: each line names every thread's innermost frames as the probe woke (the holder's may
already have moved on).

    python bench/gil_gaps.py [--min-ms 30] [-- SERVER FLAGS]   # default: the demo model, 4 slots
"""
from __future__ import annotations

import argparse
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

import httpx

from harness import ServerProcess, demo_model_path

MARK = "GIL-GAP"
WAITING = {"threading.py", "queue.py", "selectors.py", "thread.py", "handlers.py"}  # an idle thread's innermost frame: not shown
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "user", "content": "Hi"}]
REQUESTS = [  # (kind, path, body): one of each shape a first request may take
    ("completion", "/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
    ("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
    ("stream", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True}),
    ("json_schema", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}),
    ("forced tool", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "tools": [TOOL],
                                             "tool_choice": "required"}),
    ("gbnf", "/v1/completions", {"prompt": "Yes or no:", "max_tokens": 4, "grammar": 'root ::= "yes" | "no"'}),
    ("logprobs", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "logprobs": 5}),
    ("responses", "/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
    ("messages", "/v1/messages", {"model": "any", "messages": CHAT, "max_tokens": 4}),
    ("tokenize", "/extras/tokenize", {"input": "Hello world"}),
]


def probe(min_s: float) -> None:
    """The probe thread: each late wake-up to stderr (the server's log) with the time and frames."""
    last = time.perf_counter()
    while True:
        time.sleep(0.001)
        now = time.perf_counter()
        if now - last > min_s:
            stacks = [traceback.extract_stack(frame)[-3:] for ident, frame in sys._current_frames().items()
                      if ident != threading.get_ident()]
            frames = [" <- ".join(f"{f.name}@{Path(f.filename).name}:{f.lineno}" for f in reversed(stack))
                      for stack in stacks if Path(stack[-1].filename).name not in WAITING]
            print(f"{MARK} {time.time():.3f} {1000 * (now - last):.0f} ms | {' || '.join(frames)}",
                  file=sys.stderr, flush=True)
        last = now


def serve(min_ms: float, argv: list[str]) -> None:
    """`python -m pflash_plugin.server ARGV` with the probe beside it."""
    threading.Thread(target=probe, args=(min_ms / 1000,), daemon=True, name="gil-probe").start()
    sys.argv = ["pflash_plugin.server", *argv]
    runpy.run_module("pflash_plugin.server", run_name="__main__", alter_sys=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # the server's own flags pass through
    parser.add_argument("--min-ms", type=float, default=30.0, help="log gaps longer than this")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server side
    args, server_args = parser.parse_known_args()
    server_args = [a for a in server_args if a != "--"]
    if args.serve:
        serve(args.min_ms, server_args)
        return 0
    server_args = server_args or ["--model", demo_model_path(), "--n_ctx", "8192", "--max_concurrency", "4"]
    server = ServerProcess("gil-gaps", server_args, ready_paths=("/health",),
                           program=[sys.executable, str(Path(__file__).resolve()), "--serve", "--min-ms", str(args.min_ms)])
    server.start(600)
    ready = time.time()
    try:
        for kind, path, body in REQUESTS:
            started = time.perf_counter()
            reply = httpx.post(server.url + path, json=body, timeout=120)
            print(f"{kind:12s} HTTP {reply.status_code} in {1000 * (time.perf_counter() - started):6.0f} ms")
    finally:
        server.stop()
    gaps = [line.split(" ", 3) for line in server.log_path.read_text().splitlines() if line.startswith(MARK)]
    before = [g for g in gaps if float(g[1]) < ready]
    print(f"before ready: {len(before)} gaps over {args.min_ms:g} ms, longest "
          f"{max((float(g[2]) for g in before), default=0):.0f} ms")
    after = [g for g in gaps if float(g[1]) >= ready]
    print(f"after ready: {len(after)} gaps over {args.min_ms:g} ms")
    for gap in after:
        print(f"  {gap[2]} {gap[3][:400]}")
    return 1 if after else 0


if __name__ == "__main__":
    sys.exit(main())
