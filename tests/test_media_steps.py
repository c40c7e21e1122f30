"""How an image prompt's steps run (issue 46, engine/steps.py `_text_after_media`): the text after an
image goes into the token batch of the step that decodes the image's last piece (the media calls
run first), so its first token comes a step sooner, with the same tokens and logprobs as llama.cpp's
own path (mtmd_helper_eval_chunks), beside text requests, for LLaVA's causal images and M-RoPE's."""
from __future__ import annotations

import os

import pytest

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.media import MEDIA_MARKER, MediaInput
from pflash_plugin.engine.request import Request, SamplingParams, TextEvent, TokenOutput
from pflash_plugin.llama.media import mtmd_available
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector
from pflash_plugin.testing.media_files import ppm
from pflash_plugin.testing.mtmd_reference import compare, mtmd_reference

from conftest import run_requests

if os.environ.get("PFLASH_NO_MTMD") == "1" and not mtmd_available():
    pytest.skip("llama_cpp built without libmtmd on purpose (PFLASH_NO_MTMD=1)", allow_module_level=True)

PROMPT = f"<s><|im_start|>user\nlook at {MEDIA_MARKER} the picture and tell<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("kind, model_kw", [("mlp", {}), ("qwen2vl", {"arch": "qwen2vl"})])
def test_an_images_first_token_comes_from_the_step_of_its_last_piece(kind, model_kw):
    """Step 1 prefills the text before the image; step 2 decodes the image and the text after it and
    samples the first token (it was step 3: the text after the image waited for a step of its own)."""
    model_path = cached_tiny_llama(**model_kw)
    config = EngineConfig(n_slots=3, max_ctx=512, n_batch=256, n_ubatch=256, n_threads=1, n_threads_batch=1,
                          mmproj=str(cached_tiny_projector(kind=kind)))
    model, engine = load_engine(model_path, config)
    try:
        image = MediaInput("image", ppm(1), "image/x-portable-pixmap")
        built = engine.media.prompt(PROMPT, [image])
        engine.media.want(built.spans)
        built.spans[0].embeddings.result(timeout=60)  # encoded: nothing waits on the worker
        request = Request(built.tokens, SamplingParams(max_tokens=8, temperature=0.0, logprobs=5), media=built.spans)
        text = Request(model.tokenize("the water is", True), SamplingParams(max_tokens=12, temperature=0.0))
        first: dict[int, int] = {}
        outputs: list[TokenOutput] = []

        def record(rid: int, event: object) -> None:
            if isinstance(event, TextEvent):
                first.setdefault(rid, engine.steps)
                if rid == request.request_id:
                    outputs.extend(event.tokens)

        before = engine.steps
        run_requests(engine, [request, text], on_event=record)
        assert first[request.request_id] - before == 2
        expected = mtmd_reference(model, cached_tiny_projector(kind=kind), PROMPT, [(image.kind, image.data)],
                                  len(request.output_tokens), n_batch=256)
        parity = compare(expected, outputs, tolerance=1e-3)
        assert parity.tokens_equal and parity.ok, (parity, request.output_tokens, expected.tokens)
    finally:
        engine.stop()
        engine.close()


def test_a_mixed_steps_gaps_get_filler_rows_and_every_token_and_cell_stays_as_without(tiny_model):
    """Steady steps (a GPU's, a KV stream per slot): in a step of image pieces and text chunks beside
    decode rows, a slot between the token batch's rows that has none (its image piece does not end
    the image, or it waits) gets a filler row, so the decode rows stay one ubatch; its write is
    dropped after the step. The same tokens as without, and every slot's KV exactly its tokens."""
    runs = {}
    for steady in (False, True):
        config = EngineConfig(n_slots=3, max_ctx=512, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1,
                              mmproj=str(cached_tiny_projector()), kv_layout="per_slot", steady_decode=steady,
                              prefill_chunk=16)  # room left beside the chunks: the fillers fit
        model, engine = load_engine(tiny_model, config)
        try:
            built = engine.media.prompt(PROMPT, [MediaInput("image", ppm(3), "image/x-portable-pixmap")])
            engine.media.want(built.spans)
            built.spans[0].embeddings.result(timeout=60)
            # admitted shortest prompt first: the short text at slot 0, the image at 1, the long text at 2
            requests = [Request(model.tokenize("the water is", True), SamplingParams(max_tokens=24, temperature=0.0)),
                        Request(built.tokens, SamplingParams(max_tokens=8, temperature=0.0), media=built.spans),
                        Request(model.tokenize(" and the sky".join(["the sea"] * 30), True),
                                SamplingParams(max_tokens=8, temperature=0.0))]
            held: list[int] = []
            launch = engine.runner.launch

            def watched(step):
                held.extend(item.request.held_slot for item in step.items
                            if item.filler and engine.scheduler.slots[item.request.held_slot].request is not None)
                launch(step)

            engine.runner.launch = watched
            run_requests(engine, requests)
            engine.stop()
            ctx = engine.runner.ctx
            for slot in engine.scheduler.slots:
                assert ctx.memory.seq_pos_max(slot.index) + 1 == len(slot.tokens)
            assert [r.held_slot for r in requests] == [0, 1, 2]
            runs[steady] = [r.output_tokens for r in requests], held
        finally:
            engine.close()
            model.close()
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == [] and 1 in runs[True][1]
