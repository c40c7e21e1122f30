"""Prefill once on a real llama.cpp context (tiny model, both KV layouts): the n choices of one
prompt decode its tokens once, the others reuse its cells, and what they generate agrees with
separate prefills (exactly where the batch shape is the same, DESIGN.md 3)."""
from __future__ import annotations

import pytest

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.prefixes import common_prefix
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.engine.scheduler import Step

from test_engine_real import run_together

TEXT = " ".join(f"sentence {i} of a long shared document about rivers and hills." for i in range(30))


def count_prompt_tokens(engine, n_prompt: int) -> list[int]:
    """Record the prompt tokens each launched step decodes (positions before `n_prompt`)."""
    counted: list[int] = []
    launch = engine.runner.launch

    def counting(step: Step) -> None:
        counted.append(sum(len(item.tokens[:max(n_prompt - item.start_pos, 0)]) for item in step.items))
        launch(step)

    engine.runner.launch = counting
    return counted


@pytest.mark.parametrize("layout", ["unified", "per_slot"])
def test_the_choices_of_one_prompt_decode_its_tokens_once_and_agree_with_separate_prefills(tiny_model, layout):
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=1024, kv_layout=layout,
                                                         n_threads=1, n_threads_batch=1))
    try:
        prompt = model.tokenize(TEXT)
        assert len(prompt) > 300
        greedy = SamplingParams(max_tokens=6, temperature=0)
        counted = count_prompt_tokens(engine, len(prompt))
        alone = run_together(engine, [Request(prompt, greedy)])[0]
        engine.clear_prefix_cache()
        counted.clear()
        shared = run_together(engine, [Request(prompt, greedy) for _ in range(3)])
        assert sum(counted) == len(prompt) + 2  # the prompt once, then each follower's last token
        stats = engine.stats().cache
        assert stats.prefix_reused_tokens["copied"] == 2 * (len(prompt) - 1)  # from the leader's slot
        assert shared[0] == alone  # the leader prefilled as the lone request did
        assert shared[1] == shared[2]  # the followers ran the same batch shapes
        assert shared[1][0] == alone[0]  # other shapes: the first token agrees (DESIGN.md 3)

        engine.clear_prefix_cache()
        engine.scheduler.sharing.min_tokens = None  # each choice prefills its own
        counted.clear()
        separate = run_together(engine, [Request(prompt, greedy) for _ in range(3)])
        assert sum(counted) == 3 * len(prompt)
        assert separate[1] == separate[2] and separate[0][0] == shared[1][0]
        sched = engine.scheduler
        assert not sched.live and sched.cache.used_pages == sum(len(s.pages) for s in sched.slots)
        for slot in sched.slots:  # the real KV holds exactly what each idle cache says
            assert engine.runner.ctx.memory.seq_pos_max(slot.index) == len(slot.tokens) - 1
    finally:
        engine.stop()


@pytest.mark.demo
@pytest.mark.parametrize("layout", ["unified", "per_slot"])
def test_on_the_demo_model_shared_choices_stay_close_to_separate_prefills(demo_model, layout):
    """Gemma 3's sliding-window KV (whole-context SWA cells) shared or copied: the leader answers as
    the lone request (the same batch shapes), the others as separate prefills do within batch-shape
    numerics (DESIGN.md 3)."""
    model, engine = load_engine(demo_model, EngineConfig(n_slots=4, max_ctx=1024, kv_layout=layout))
    try:
        prompt = model.tokenize("Once upon a time, in a small village by the river, " + TEXT[:3000])
        greedy = SamplingParams(max_tokens=8, temperature=0)
        alone = run_together(engine, [Request(prompt, greedy)])[0]
        engine.clear_prefix_cache()
        counted = count_prompt_tokens(engine, len(prompt))
        shared = run_together(engine, [Request(prompt, greedy) for _ in range(3)])
        assert sum(counted) == len(prompt) + 2
        engine.clear_prefix_cache()
        engine.scheduler.sharing.min_tokens = None
        separate = run_together(engine, [Request(prompt, greedy) for _ in range(3)])
    finally:
        engine.stop()
    assert shared[0] == alone and shared[1] == shared[2]
    assert len({s[0] for s in shared + separate}) == 1
    prefixes = [common_prefix(s, t) for s, t in zip(shared, separate)]
    assert sum(prefixes) / len(prefixes) >= 4, prefixes
