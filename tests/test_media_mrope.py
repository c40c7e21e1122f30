"""Images at M-RoPE positions in the batched engine (issue 46; Qwen2-VL to Qwen3.5): a tiny text
model of arch qwen2vl (rope sections in its GGUF) with a tiny Qwen2-VL projector (qwen2vl_merger).
An image's nx x ny cells take max(nx, ny) positions, each embedding 4 (t, y, x, z): parity with
llama.cpp's own path (mtmd_helper_eval_chunks) beside text requests, a later turn reusing the
image's cells, and the position rules of a slot's token list."""
from __future__ import annotations

import os

import numpy as np
import pytest
from test_media_engine import FIRST_STEP, OUTPUTS, PROMPT, compressed_around, ppm, run

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.media import MediaInput
from pflash_plugin.engine.positions import kv_position, position, whole_media
from pflash_plugin.engine.prefixes import reusable
from pflash_plugin.engine.request import FinishEvent, Request, SamplingParams
from pflash_plugin.llama import Batch, Context, ContextConfig, Model
from pflash_plugin.llama.media import SAME_POSITION, Projector, helper_decode_chunk, mtmd_available
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector
from pflash_plugin.testing.mtmd_reference import log_softmax, mtmd_reference

if os.environ.get("PFLASH_NO_MTMD") == "1" and not mtmd_available():
    pytest.skip("llama_cpp built without libmtmd on purpose (PFLASH_NO_MTMD=1)", allow_module_level=True)

TURN = PROMPT  # the same turn as test_media_engine (compressed_around reads it)
# measured 4e-9 to 7e-9 apart; text after the image at its index instead of its position: 4e-4 to 6e-3
# (the tiny model's attention is nearly uniform, so a position moves its logits little)
TOLERANCE = 1e-5
NEXT = TURN + "it is water<|im_end|>\n<|im_start|>user\nand the house by the land<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int, width: int = 80, height: int = 48) -> MediaInput:
    """80 x 48 pixels: 5 x 3 merged patches, 15 cells at 5 positions."""
    return MediaInput("image", ppm(seed, width, height), "image/x-portable-pixmap")


def mrope_model() -> str:
    return str(cached_tiny_llama(arch="qwen2vl"))


def projector_path() -> str:
    return str(cached_tiny_projector(kind="qwen2vl"))


@pytest.fixture(scope="module")
def engine():
    # n_batch 8 < the image's 15 cells: an image decodes in two steps
    config = EngineConfig(n_slots=3, max_ctx=512, n_batch=8, n_ubatch=8, n_threads=1, n_threads_batch=1,
                          mmproj=projector_path(), prefill_chunk=8)
    model, engine = load_engine(mrope_model(), config)
    yield model, engine
    engine.stop()
    engine.close()


def media_request(eng, text: str, media: MediaInput, max_tokens: int = 10) -> Request:
    prompt = eng.media.prompt(text, [media])
    return Request(prompt.tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5),
                   media=prompt.spans)


def reference(model: Model, text: str, media: MediaInput, n_tokens: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's own path on a one-sequence context: the greedy tokens and the first one's
    log-softmax."""
    ref = mtmd_reference(model, projector_path(), text, [(media.kind, media.data)], n_tokens, n_batch=8, n_ctx=512)
    return ref.tokens, ref.logprobs[0]


def assert_parity(model: Model, request: Request, text: str, media: MediaInput) -> None:
    tokens, first = reference(model, text, media, len(request.output_tokens))
    assert request.output_tokens == tokens
    top = OUTPUTS[request.request_id][0].top_logprobs
    assert top and len(top) == 5
    for token, logprob in top:
        assert abs(logprob - first[token]) < TOLERANCE, (token, logprob, first[token])


def test_an_image_takes_its_cells_at_fewer_positions(engine):
    _, eng = engine
    prompt = eng.media.prompt(TURN, [image(1)])
    [span] = prompt.spans
    chunk = span.chunk
    assert eng.media.projector.mrope and chunk.mrope_image
    assert (chunk.n_tokens, chunk.n_pos) == (15, 5)  # 5 x 3 cells, max(5, 3) positions
    assert prompt.tokens[span.start : span.end].count(SAME_POSITION) == 10
    # t is the image's first position for every cell, y the row, x the column (libmtmd's decoder_pos)
    at = chunk.positions(7)
    assert (at[0] == 7).all() and list(at[1]) == [7] * 5 + [8] * 5 + [9] * 5 and list(at[2][:6]) == [7, 8, 9, 10, 11, 7]
    # after the image, a position is its index less the cells that took none (llama-server's pos_next)
    for index in (span.start, span.end, span.end + 3, len(prompt.tokens)):
        expected = index if index <= span.start else index - 10
        assert position(prompt.spans, index) == kv_position(prompt.tokens, index) == expected
    # a prefix never ends inside such an image: its cells share one KV position
    assert whole_media(prompt.tokens, span.start + 4) == span.start
    assert reusable(prompt.tokens[: span.start + 4], prompt.tokens) == span.start
    assert reusable(prompt.tokens, prompt.tokens) == len(prompt.tokens) - 1


def test_greedy_tokens_after_an_image_match_llama_cpps_own_path_beside_text(engine):
    model, eng = engine
    eng.clear_prefix_cache()
    text = [Request(model.tokenize(f"the prompt {i} about water", True), SamplingParams(max_tokens=10, temperature=0.0))
            for i in range(2)]
    alone = [Request(list(r.prompt_tokens), SamplingParams(max_tokens=10, temperature=0.0)) for r in text]
    run(eng, alone)
    request = media_request(eng, TURN, image(1))
    submitted = eng.steps
    ends = run(eng, [request, *text])
    assert all(isinstance(e, FinishEvent) and e.reason == "length" for e in ends)
    assert_parity(model, request, TURN, image(1))
    assert [r.output_tokens for r in text] == [r.output_tokens for r in alone]
    assert all(FIRST_STEP[r.request_id] - submitted <= 2 for r in text)
    assert ends[0].usage.media_tokens == 15 and ends[0].usage.prompt_tokens == len(request.prompt_tokens)
    other = media_request(eng, TURN, image(2))
    run(eng, [other])
    assert other.output_tokens != request.output_tokens


def test_a_later_turn_reuses_the_images_cells_at_their_positions(engine):
    model, eng = engine
    eng.clear_prefix_cache()
    first = media_request(eng, TURN, image(3))
    run(eng, [first])
    before = eng.media.stats()
    later = media_request(eng, NEXT, image(3))
    usage = run(eng, [later])[0].usage
    assert usage.cached_tokens >= later.media[0].end  # the image's cells came from the prefix cache
    assert eng.media.stats().encoded == before.encoded
    assert_parity(model, later, NEXT, image(3))


def test_two_images_in_two_slots_decode_together_at_their_own_positions(engine):
    model, eng = engine
    # different text before each image: their first positions differ
    texts = [TURN, TURN.replace("look at", "now look at the house and")]
    requests = [media_request(eng, text, image(5 + i)) for i, text in enumerate(texts)]
    run(eng, requests)
    for request, text, seed in zip(requests, texts, (5, 6)):
        assert_parity(model, request, text, image(seed))


def test_pflash_keeps_an_mrope_image_whole_and_the_engine_decodes_it_at_its_new_positions(engine):
    """PFlash drops text around the image; the engine prefills the kept tokens with the image at
    the position after the text kept before it, and the text after it n_pos further on: as
    llama.cpp's own decode of those tokens and that chunk (mtmd_helper_decode_image_chunk)."""
    model, eng = engine
    prompt, result, moved = compressed_around(engine, image(1))
    assert result.report.status == "compressed" and len(result.tokens) < len(prompt.tokens) - 40
    [span] = prompt.spans
    assert moved.start < span.start and result.tokens[moved.start : moved.end] == prompt.tokens[span.start : span.end]
    request = Request(prompt.tokens, SamplingParams(max_tokens=6, temperature=0.0, logprobs=5),
                      prefill_tokens=result.tokens, media=(moved,))
    end = run(eng, [request])[0]
    assert end.reason == "length" and end.usage.media_tokens == 15 and request.n_prefilled == len(result.tokens)
    ctx = Context(model, ContextConfig(n_ctx=512, n_batch=256, n_ubatch=8, n_threads=1, n_threads_batch=1))
    projector, batch = Projector(projector_path(), model), Batch(256)
    try:
        def text_at(tokens: list[int], pos: int) -> int:
            batch.clear()
            for i, token in enumerate(tokens):
                batch.add(token, pos + i, 0, i == len(tokens) - 1)
            ctx.decode(batch)
            return pos + len(tokens)

        pos = text_at(result.tokens[: moved.start], 0)
        pos = helper_decode_chunk(projector, ctx, moved.chunk, pos, 8)
        text_at(result.tokens[moved.end :], pos)
        assert int(np.argmax(ctx.logits(-1))) == request.output_tokens[0]
        expected = log_softmax(ctx.logits(-1))
        for token, logprob in OUTPUTS[request.request_id][0].top_logprobs:
            assert abs(logprob - expected[token]) < TOLERANCE
    finally:
        batch.close()
        projector.close()
        ctx.close()


def test_over_http_an_image_chat_beside_a_text_chat_and_a_resent_image():
    """The server's path (each item tokenized by the projector, media_tokens in usage) with the
    M-RoPE pair: the text chat answers as alone, streamed as plain, the resent image from the cache."""
    import base64
    import threading

    from conftest import live_server
    from test_media_http import post, streamed, text_chat

    from pflash_plugin.testing.media_files import png

    model = {"model": mrope_model(), "model_alias": "vision", "mmproj": projector_path(), "n_ctx": 1024,
             "max_concurrency": 3, "n_threads": 1, "n_threads_batch": 1}
    url = "data:image/png;base64," + base64.b64encode(png(80, 48, 3)).decode()
    content = [{"type": "text", "text": "what is in the picture"}, {"type": "image_url", "image_url": {"url": url}}]
    chat = {"model": "vision", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    with live_server([model]) as live:
        alone = post(live, text_chat())["choices"][0]["message"]["content"]
        results: dict[str, dict] = {}
        threads = [threading.Thread(target=lambda: results.update(image=post(live, chat))),
                   threading.Thread(target=lambda: results.update(text=post(live, text_chat())))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results["text"]["choices"][0]["message"]["content"] == alone
        answer, usage = results["image"]["choices"][0]["message"]["content"], results["image"]["usage"]
        assert answer and usage["prompt_tokens_details"]["media_tokens"] == 15  # 5 x 3 cells
        text, streamed_usage = streamed(live, chat)
        assert text == answer and streamed_usage is not None
        assert streamed_usage["prompt_tokens"] == usage["prompt_tokens"]
        again = post(live, chat)
        assert again["choices"][0]["message"]["content"] == answer
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 15


def test_a_step_aborted_after_writing_part_of_an_image_is_redone_from_the_images_start(engine, monkeypatch):
    """The image goes in two steps (8 + 7 cells). The second step's call writes its cells, then
    reports the decode aborted (as llama.cpp does after some ubatches landed): its cells share the
    image's one KV position with the first step's, so the step is taken back to the image's start
    and both pieces decoded again; no cell is there twice (an embedding batch may repeat M-RoPE
    positions: llama.cpp would take duplicates silently)."""
    from pflash_plugin.llama import DecodeError

    model, eng = engine
    decoder, calls, raised = eng.runner.media, [], []
    flush = decoder._flush

    def aborted(batch, non_causal: bool) -> None:
        if batch.n_tokens:
            calls.append(batch.n_tokens)
        flush(batch, non_causal)
        if batch.n_tokens == 0 and len(calls) == 2 and not raised:
            raised.append(True)
            raise DecodeError(2)  # the second call's cells landed

    monkeypatch.setattr(decoder, "_flush", aborted)
    request = media_request(eng, TURN, image(9))
    end = run(eng, [request])[0]
    assert isinstance(end, FinishEvent), end
    assert calls == [8, 7, 8, 7]  # a step each, the second aborted, then the image again from its start
    assert_parity(model, request, TURN, image(9))


def test_a_step_whose_token_batch_finds_no_cells_after_its_image_piece_is_redone_without_it(engine, monkeypatch):
    """A step decodes an image piece, then its token batch (a text request's row beside it) finds
    no free KV cells (llama.cpp writes nothing for that call, but the piece's cells stay): the step
    is retried once idle caches are evicted, from each slot's known cells, so no cell is there
    twice (an embedding batch may repeat M-RoPE positions: llama.cpp takes duplicates silently)."""
    from pflash_plugin.llama import Batch as TokenBatch
    from pflash_plugin.llama import DecodeError

    model, eng = engine
    eng.clear_prefix_cache()
    # an idle cache to evict (no BOS: the requests below share no prefix with it, so go elsewhere)
    run(eng, [Request(model.tokenize("the water is", False), SamplingParams(max_tokens=4, temperature=0.0))])
    runner, raised, media_in_step = eng.runner, [], [False]
    decode_media, ctx_decode = runner._decode_media, runner.ctx.decode

    def step_media(step) -> None:
        media_in_step[0] = any(item.media is not None for item in step.items)
        decode_media(step)

    def flaky(batch) -> None:
        if isinstance(batch, TokenBatch) and media_in_step[0] and not raised:
            raised.append(True)
            raise DecodeError(1)
        ctx_decode(batch)

    monkeypatch.setattr(runner, "_decode_media", step_media)
    monkeypatch.setattr(runner.ctx, "decode", flaky)
    text = Request(model.tokenize("the prompt about water", True), SamplingParams(max_tokens=30, temperature=0.0))
    alone = Request(list(text.prompt_tokens), SamplingParams(max_tokens=30, temperature=0.0))
    request = media_request(eng, TURN, image(10))
    ends = run(eng, [text, request])
    assert raised and all(isinstance(end, FinishEvent) for end in ends), ends
    assert_parity(model, request, TURN, image(10))
    monkeypatch.undo()
    run(eng, [alone])
    assert text.output_tokens == alone.output_tokens


def test_prompt_lookup_drafts_up_to_an_images_pseudo_ids(engine):
    """Prompt lookup copies what followed the row's last tokens where they occurred before: in a
    prompt with an image, the text before the image is followed by its pseudo-ids, which are no
    tokens (a draft of one would fail the step's decode for every row in it)."""
    from pflash_plugin.engine.speculation.ngram import NgramProposer
    from pflash_plugin.engine.speculation.proposer import DraftRow

    _, eng = engine
    prompt = eng.media.prompt(TURN, [image(1)])
    start = prompt.spans[0].start

    def drafts(last: list[int]) -> list[int]:
        return NgramProposer(max_ngram_size=3).propose([DraftRow(1, [*prompt.tokens, *last], 4)])[0]

    # the three tokens right before the image (the end of '<|vision_start|>', spelled out by the
    # tiny vocabulary), generated again: nothing to draft; three earlier: up to the image
    assert drafts(prompt.tokens[start - 3 : start]) == []
    assert drafts(prompt.tokens[start - 6 : start - 3]) == prompt.tokens[start - 3 : start]


def test_stocks_qwen25_vl_chat_format_serves_an_mrope_pair():
    """Stock's `chat_format: qwen2.5-vl` (its Qwen25VLChatHandler's template) with an M-RoPE pair:
    refused at start before; now the image is answered with its 15 tokens."""
    import base64

    from conftest import live_server
    from test_media_http import post

    from pflash_plugin.testing.media_files import png

    model = {"model": mrope_model(), "model_alias": "vision", "mmproj": projector_path(), "n_ctx": 1024,
             "max_concurrency": 1, "n_threads": 1, "n_threads_batch": 1, "chat_format": "qwen2.5-vl"}
    url = "data:image/png;base64," + base64.b64encode(png(80, 48, 3)).decode()
    content = [{"type": "text", "text": "what is in the picture"}, {"type": "image_url", "image_url": {"url": url}}]
    with live_server([model]) as live:
        got = post(live, {"model": "vision", "messages": [{"role": "user", "content": content}], "max_tokens": 4})
    assert got["choices"][0]["message"]["content"] and got["usage"]["prompt_tokens_details"]["media_tokens"] == 15
