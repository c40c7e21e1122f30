"""The cost of reading a streamed tool call, per piece, as the call grows: one call whose one
argument goes on for N pieces of 4 characters, read by the chat layer's ToolCallReader as a stream
(chat/tool_calls.py: the JSON scanner for Hermes, the tagged one for Qwen3-Coder and DeepSeek
V3.1). Flat microseconds per piece from the smallest N to the largest is O(1) per token. Prints
one JSON line per syntax and N.

    python bench/tool_reading.py --pieces 25000 100000 400000
"""
from __future__ import annotations

import argparse
import json
import time

from pflash_plugin.chat.tool_calls import SYNTAXES, ToolCallReader

HEADS = {  # a call of get_time whose zone value goes on
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "',
    "qwen3_coder": "<tool_call>\n<function=get_time>\n<parameter=zone>\n",
    "deepseek_v3_1": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "',
}
SCHEMA = {"get_time": {"type": "object", "properties": {"zone": {"type": "string"}}}}


def per_piece_us(syntax_name: str, pieces: int) -> float:
    reader = ToolCallReader(SYNTAXES[syntax_name], True, SCHEMA, SCHEMA)
    reader.read(HEADS[syntax_name], None, True)
    start = time.perf_counter()
    for _ in range(pieces):
        reader.read("abcd", None, True)
    return (time.perf_counter() - start) * 1e6 / pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pieces", type=int, nargs="+", default=[25_000, 100_000, 400_000])
    args = parser.parse_args()
    for name in HEADS:
        for pieces in args.pieces:
            print(json.dumps({"syntax": name, "pieces": pieces, "characters": 4 * pieces,
                              "us_per_piece": round(per_piece_us(name, pieces), 2)}))


if __name__ == "__main__":
    main()
