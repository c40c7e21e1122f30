"""Talk to pflash_plugin.server with the official OpenAI client, PFlash override included.

python examples/client.py [--base-url http://localhost:8000/v1]
"""
from __future__ import annotations

import argparse

from openai import OpenAI

from pflash_plugin.testing.haystack import needle_prompt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://localhost:8000/v1")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")

    prompt, code = needle_prompt(3500, 0.5, seed=7)
    reply = client.completions.create(
        model="any", prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"pflash": {"mode": "always", "keep_ratio": 0.2}},
    )
    timings = reply.usage.model_extra["timings"]
    print(f"answer {reply.choices[0].text!r} (hidden code {code})")
    print(f"prompt tokens {reply.usage.prompt_tokens}, TTFT {timings['ttft_ms']:.0f} ms, "
          f"pflash {timings.get('pflash')}")

    # the demo model is a base model: it continues text (for chat, serve the instruct demo model,
    # --model demo-chat, and call client.chat.completions.create(messages=[...]): README's "Using it")
    stream = client.completions.create(
        model="any", prompt="Three rivers of Europe: the Danube, the", max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            print(chunk.choices[0].text, end="", flush=True)
        if chunk.usage:
            print(f"\nusage: {chunk.usage.completion_tokens} tokens")


if __name__ == "__main__":
    main()
