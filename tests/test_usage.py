"""The engine's usage records in each API's words (server/wire/usage.py): the JSON clients read, key for
key, for one choice and for several (each prompt once, completions summed, the most cached)."""
from pflash_plugin.engine.request import Latency, Usage
from pflash_plugin.pflash.report import PflashReport
from pflash_plugin.server.wire.usage import anthropic_usage, openai_usage, responses_usage, totals

LATENCY = Latency(queue_ms=1.0, compress_ms=2.0, prefill_ms=3.0, ttft_ms=4.0, decode_ms=5.0, prepare_ms=6.0,
                  release_ms=7.0, emit_ms=8.0)
TIMINGS = {"queue_ms": 1.0, "compress_ms": 2.0, "prefill_ms": 3.0, "ttft_ms": 4.0, "decode_ms": 5.0, "prepare_ms": 6.0,
           "release_ms": 7.0, "emit_ms": 8.0}


def test_one_choice_is_its_own_usage_with_the_pflash_report_in_its_timings():
    report = PflashReport("compressed", 40, kept_tokens=10, keep_ratio=0.25)
    used = totals([Usage(40, 3, 8, LATENCY, report)], prompt_tokens=99)  # one choice: its own prompt count
    assert openai_usage(used) == {
        "prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43, "prompt_tokens_details": {"cached_tokens": 8},
        "timings": {**TIMINGS, "cached_tokens": 8, "pflash": report.to_json()}}
    assert list(openai_usage(used)["timings"]) == [*TIMINGS, "cached_tokens", "pflash"]
    assert responses_usage(used) == {
        "input_tokens": 40, "output_tokens": 3, "total_tokens": 43, "input_tokens_details": {"cached_tokens": 8},
        "output_tokens_details": {"reasoning_tokens": 0}, "timings": openai_usage(used)["timings"]}
    assert anthropic_usage(used) == {
        "input_tokens": 32, "output_tokens": 3, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 0,
        "timings": openai_usage(used)["timings"]}


def test_several_choices_count_the_prompt_once_and_list_every_choices_timings():
    first, second = Usage(6, 3, 4, LATENCY), Usage(6, 5, 9, LATENCY)  # cached over the prompt: capped
    assert openai_usage(totals([first, second], prompt_tokens=6)) == {
        "prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 6},
        "timings": {**TIMINGS, "cached_tokens": 4,
                    "choices": [{**TIMINGS, "cached_tokens": 4}, {**TIMINGS, "cached_tokens": 9}]}}
