"""A window-sized SWA KV cache (--swa_full false) gives the text a full one gives: long prompts,
a follow-up reusing a cached prompt at its end, and a prompt sharing only an early prefix with a
cached one (whose window cells are gone, so it must prefill afresh, not attend to missing cells)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import pytest

from pflash_plugin.engine.engine import Engine
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import FinishEvent, Request, SamplingParams
from pflash_plugin.llama.tiny_gguf import cached_tiny_llama

N_SWA = 32


@pytest.fixture(scope="module")
def tiny_gemma3():
    # weights spread wider than the llama's so that attention (the context) steers the greedy text
    return str(cached_tiny_llama(arch="gemma3", sliding_window=N_SWA, n_layer=6, scale=0.1))


def run(engine, tokens: list[int]) -> tuple[list[int], int]:
    """One greedy request alone: its output tokens and the prompt tokens it reused from the KV."""
    done = threading.Event()
    request = Request(list(tokens), SamplingParams(max_tokens=12, temperature=0.0))
    request.sink = lambda event: done.set() if isinstance(event, FinishEvent) else None
    engine.submit(request)
    assert done.wait(120), "request did not finish"
    return request.output_tokens, request.cached_tokens


@contextmanager
def engine_of(path: str, swa_full: bool, host_cache_bytes: int = 0, n_slots: int = 1) -> Iterator[Engine]:
    """An engine of `n_slots` on the tiny gemma3, its SWA cache full or window-sized, with a host-RAM
    tier of that many bytes (0: none)."""
    config = EngineConfig(n_slots=n_slots, max_ctx=1024, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1,
                          swa_full=swa_full, host_cache_bytes=host_cache_bytes, host_cache_min_tokens=64)
    model, engine = load_engine(path, config)
    try:
        assert model.n_swa == N_SWA
        yield engine
    finally:
        engine.stop()
        engine.close()
        model.close()


def turns(path: str, swa_full: bool, prompts: list[list[int]],
          host_cache_bytes: int = 0) -> list[tuple[list[int], int]]:
    with engine_of(path, swa_full, host_cache_bytes) as engine:
        return [run(engine, p) for p in prompts]


def words(seed: int, n: int) -> list[int]:
    return [300 + (seed * 7919 + i * 31) % 200 for i in range(n)]


def test_a_long_prompt_and_a_follow_up_at_its_end_match_a_full_cache(tiny_gemma3):
    first = words(1, 400)  # several ubatches past the window
    full = turns(tiny_gemma3, True, [first])
    follow = first + full[0][0] + words(2, 40)
    full += turns(tiny_gemma3, True, [follow])[:1]
    window = turns(tiny_gemma3, False, [first, follow])
    assert [out for out, _ in window] == [out for out, _ in full]
    assert window[1][1] >= len(first)  # the follow-up reused the cached turn at its end


def test_a_prompt_sharing_only_an_early_prefix_prefills_afresh(tiny_gemma3):
    cached = words(3, 800)  # past the window cache's 256 cells: its first ~550 are overwritten
    later = cached[:200] + words(4, 100)
    full = turns(tiny_gemma3, True, [cached, later])
    window = turns(tiny_gemma3, False, [cached, later])
    assert [out for out, _ in window] == [out for out, _ in full]  # stale cells would change the text
    assert full[1][1] >= 200 and window[1][1] == 0  # the window's cells at 200 are gone: no reuse


def test_a_restore_from_host_ram_sharing_only_an_early_prefix_prefills_afresh(tiny_gemma3):
    """A sequence saved to the host tier (its slot taken by another prompt) and restored for a prompt
    sharing only its beginning: the window cache saved only its last cells, so the restore is undone
    and the prompt prefilled afresh, as alone; with a full cache the same restore is kept (its text
    may differ from a fresh prefill's: a prompt prefilled in other pieces, docs/limits.md)."""
    cached, other = words(3, 800), words(5, 100)
    later = cached[:300] + words(4, 100)
    full, window = (turns(tiny_gemma3, f, [cached, other, later], host_cache_bytes=256 << 20) for f in (True, False))
    assert full[2][1] >= 300 and window[2][1] == 0
    assert window[2][0] == turns(tiny_gemma3, True, [later])[0][0]  # the text of a fresh prefill


def test_a_copy_from_another_slot_sharing_only_an_early_prefix_prefills_afresh(tiny_gemma3):
    """A prompt sharing only the first 300 tokens of an idle slot's cached sequence, while another
    request runs two slots away, is placed beside the running one with that prefix copied across
    (slot_placement: the long cache kept, no ubatch of its own); with a window-sized cache those
    cells are gone, so nothing is copied and it prefills afresh, as alone."""
    cached, later = words(3, 800), words(3, 300) + words(4, 100)

    def copied(swa_full: bool) -> tuple[list[int], int, int]:
        with engine_of(tiny_gemma3, swa_full, n_slots=4) as engine:
            run(engine, cached)  # slot 0
            run(engine, words(7, 50))  # slot 1: a cache, so that the running request takes slot 2
            started, done = threading.Event(), threading.Event()
            running = Request(words(8, 40), SamplingParams(max_tokens=400, min_tokens=400, temperature=0.0))
            running.sink = lambda event: (done if isinstance(event, FinishEvent) else started).set()
            engine.submit(running)
            assert started.wait(120)
            out, reused = run(engine, later)
            assert not done.is_set() and running.slot == 2  # placed while the other ran two slots away
            assert done.wait(120)
            return out, reused, engine.scheduler.cache.reused_tokens["copied"]

    full, window = copied(True), copied(False)
    assert full[1:] == (300, 300)  # the full cache copies the prefix to another slot
    assert window[1:] == (0, 0)
    assert window[0] == turns(tiny_gemma3, True, [later])[0][0]  # the text of a fresh prefill


def test_the_bound_is_exact_to_the_cell(tiny_gemma3):
    """The token at position p attends to cells from p - n_swa + 1: a prefix ending there is reused,
    one a cell shorter prefills afresh (reused, its text would differ from a full cache's)."""
    cached = words(3, 800)
    with engine_of(tiny_gemma3, False) as engine:
        run(engine, cached)
        first = engine.scheduler.cache.kv.first_cell(0)
    for n, reused in ((first + N_SWA - 1, True), (first + N_SWA - 2, False)):
        later = cached[:n] + words(4, 50)
        full, window = (turns(tiny_gemma3, f, [cached, later])[1] for f in (True, False))
        assert window[0] == full[0]
        assert window[1] == (n if reused else 0)


def test_over_http_swa_full_false_answers_as_true(tiny_gemma3):
    """The setting reaches the target context (its window of cells) and the answers stay the same:
    a long prompt, one sharing only its beginning, then a follow-up of that one."""
    from conftest import live_server

    cached = " ".join(f"w{(i * 31) % 97}" for i in range(300))
    prompts = [cached, cached[:300] + " and then something else", None]
    texts: dict[bool, list[str]] = {}
    cached_tokens: dict[bool, list[int]] = {}
    for swa_full in (True, False):
        settings = {"model": tiny_gemma3, "n_ctx": 1024, "n_batch": 64, "n_ubatch": 64, "max_concurrency": 1,
                    "n_threads": 1, "n_threads_batch": 1, "swa_full": swa_full}
        with live_server([settings]) as server, server.client() as client:
            texts[swa_full], cached_tokens[swa_full] = [], []
            for prompt in prompts:
                prompt = prompt or prompts[1] + texts[swa_full][-1] + " more"
                body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                                            "temperature": 0}).json()
                texts[swa_full].append(body["choices"][0]["text"])
                cached_tokens[swa_full].append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert texts[False] == texts[True]
    assert cached_tokens[True][1] > 200 and cached_tokens[False][1] == 0  # the early prefix's window is gone
    assert cached_tokens[False][2] > 200  # the follow-up goes on from the cached prompt's end
