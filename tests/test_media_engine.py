"""Images in the batched engine (issue 46), on a tiny text model and a tiny LLaVA-style projector
(pflash_plugin.testing.cached_tiny_projector): parity with llama.cpp's own path (libmtmd's
mtmd_helper_eval_chunks on a plain single-sequence context), prefix reuse of a resent image,
an image prefill beside text requests, and clear errors.

These need libmtmd: they FAIL where llama_cpp was built without it, unless PFLASH_NO_MTMD=1 says
it was left out on purpose (a GPU build with LLAVA off)."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.media import MEDIA_MARKER, MediaInput
from pflash_plugin.engine.media_prompt import build_prompt, prefill_piece
from pflash_plugin.engine.request import (ErrorEvent, ErrorKind, FinishEvent, Request, SamplingParams, TextEvent,
                                          TokenOutput)
from pflash_plugin.engine.scheduler import AdmissionError
from pflash_plugin.llama import Model
from pflash_plugin.llama.media import MediaError, Projector, mtmd_available
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector
from pflash_plugin.testing.media_files import ppm, wav
from pflash_plugin.testing.mtmd_reference import compare, mtmd_reference

from conftest import run_requests

if os.environ.get("PFLASH_NO_MTMD") == "1" and not mtmd_available():
    pytest.skip("llama_cpp built without libmtmd on purpose (PFLASH_NO_MTMD=1)", allow_module_level=True)

OUTPUTS: dict[int, list[TokenOutput]] = {}
FIRST_STEP: dict[int, int] = {}  # the engine's step count when a request's first text came out
PROMPT = f"<s><|im_start|>user\nlook at {MEDIA_MARKER} the picture and tell<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int) -> MediaInput:
    return MediaInput("image", ppm(seed), "image/x-portable-pixmap")


def run(engine, requests: list[Request], timeout: float = 60) -> list[FinishEvent | ErrorEvent]:
    """Runs the requests together; each one's TokenOutputs go to OUTPUTS[request_id]."""
    def record(rid: int, event: object) -> None:
        if isinstance(event, TextEvent):
            FIRST_STEP.setdefault(rid, engine.steps)
            OUTPUTS.setdefault(rid, []).extend(event.tokens)

    ends = run_requests(engine, requests, timeout, on_event=record)
    return [ends[r.request_id] for r in requests]


@pytest.fixture(scope="module")
def engine():
    # n_batch 24 < the image's 64 tokens: the image is decoded in pieces, between other rows' steps
    config = EngineConfig(n_slots=3, max_ctx=512, n_batch=24, n_ubatch=24, n_threads=1, n_threads_batch=1,
                          mmproj=str(cached_tiny_projector()), prefill_chunk=24)
    model, engine = load_engine(cached_tiny_llama(), config)
    yield model, engine
    engine.stop()
    engine.close()


def media_request(engine, media: MediaInput, max_tokens: int = 12) -> Request:
    prompt = engine.media.prompt(PROMPT, [media])
    return Request(prompt.tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5),
                   media=prompt.spans)


def assert_parity(model: Model, request: Request, media: MediaInput, kind: str = "mlp") -> None:
    """Greedy tokens as llama.cpp's own path, and every step's top-5 logprobs within 1e-3."""
    expected = mtmd_reference(model, cached_tiny_projector(kind=kind), PROMPT, [(media.kind, media.data)],
                              len(request.output_tokens), n_batch=24)
    outputs = OUTPUTS[request.request_id]
    assert all(out.top_logprobs and len(out.top_logprobs) == 5 for out in outputs)
    parity = compare(expected, outputs, tolerance=1e-3)
    assert parity.tokens_equal and parity.ok, (parity, request.output_tokens, expected.tokens)


def test_greedy_tokens_after_an_image_match_llama_cpps_own_path(engine):
    model, eng = engine
    request = media_request(eng, image(1))
    assert run(eng, [request])[0].reason == "length"
    assert_parity(model, request, image(1))
    # the image counts: its 64 positions are in the prompt, and another image changes the answer
    assert len(request.prompt_tokens) == 64 + len(model.tokenize(PROMPT.replace(MEDIA_MARKER, ""), False, True))
    other = media_request(eng, image(2))
    run(eng, [other])
    assert other.output_tokens != request.output_tokens


def test_a_non_causal_image_is_decoded_whole_as_llama_cpp_does(tiny_model):
    """Gemma 3's projector: libmtmd decodes its images with causal attention off, in one call; the
    engine takes such an image whole even where the step plans a smaller prefill chunk (8 < 16)."""
    config = EngineConfig(n_slots=2, max_ctx=512, n_batch=24, n_ubatch=24, n_threads=1, n_threads_batch=1,
                          mmproj=str(cached_tiny_projector(kind="gemma3")), prefill_chunk=8)
    model, eng = load_engine(tiny_model, config)
    try:
        request = media_request(eng, image(1))
        span = request.media[0]
        assert span.non_causal and span.chunk.n_tokens == 16
        eng.media.want(request.media)
        span.embeddings.result(timeout=30)
        piece = prefill_piece(request.media, span.start, 8)
        assert piece is not None and piece[0] == 16 and piece[1] is not None and len(piece[1].rows) == 16
        text = Request(model.tokenize("the water is", True), SamplingParams(max_tokens=12, temperature=0.0))
        run(eng, [request, text])
        assert_parity(model, request, image(1), kind="gemma3")
    finally:
        eng.stop()
        eng.close()


def test_a_resent_image_reuses_its_kv_and_its_embeddings(engine):
    _, eng = engine
    eng.clear_prefix_cache()
    first = media_request(eng, image(3))
    run(eng, [first])
    before = eng.media.stats()
    again = media_request(eng, image(3))
    usage = run(eng, [again])[0].usage
    span = again.media[0]
    assert usage.cached_tokens >= span.end  # the image's positions came from the prefix cache
    assert usage.media_tokens == 64 and usage.prompt_tokens == len(again.prompt_tokens)
    assert again.output_tokens == first.output_tokens
    after = eng.media.stats()
    assert after.encoded == before.encoded and after.cache_hits == before.cache_hits + 1


def test_an_image_prefills_beside_text_requests_that_answer_as_alone(engine):
    model, eng = engine
    text = [Request(model.tokenize(f"the prompt {i} about water", True), SamplingParams(max_tokens=10, temperature=0.0))
            for i in range(2)]
    alone = [Request(list(r.prompt_tokens), SamplingParams(max_tokens=10, temperature=0.0)) for r in text]
    run(eng, alone)
    with_image = media_request(eng, image(4))
    submitted = eng.steps
    ends = run(eng, [with_image, *text])
    assert all(isinstance(e, FinishEvent) for e in ends)
    # the text requests answer within two steps; the image's 64 positions take 24 a step
    assert all(FIRST_STEP[r.request_id] - submitted <= 2 for r in text)
    assert FIRST_STEP[with_image.request_id] - submitted >= 4
    assert [r.output_tokens for r in text] == [r.output_tokens for r in alone]
    assert_parity(model, with_image, image(4))


def test_two_images_prefilling_together_share_their_decode_calls(engine, monkeypatch):
    model, eng = engine
    decoder, calls, pieces = eng.runner.media, [], []
    decode, flush = decoder.decode, decoder._flush
    monkeypatch.setattr(decoder, "decode", lambda step_pieces: (pieces.extend(step_pieces), decode(step_pieces)))
    monkeypatch.setattr(decoder, "_flush", lambda batch, nc: (calls.append(batch.n_tokens), flush(batch, nc)))
    requests = [media_request(eng, image(6)), media_request(eng, image(7))]
    # both encoded before the engine sees them (else one image may prefill steps before the other's
    # encode lands, and their pieces never meet: the test's timing, not the feature under test)
    spans = [span for request in requests for span in request.media]
    eng.media.want(spans)
    for span in spans:
        span.embeddings.result(timeout=60)
    # a request decoding beside them: the step policy then gives each prompt a chunk of every step
    text = Request(model.tokenize("the water", True), SamplingParams(max_tokens=40, temperature=0.0))
    run(eng, [text, *requests])
    assert len({p.seq_id for p in pieces}) == 2
    assert sum(len(p.rows) for p in pieces) == 2 * 64 and sum(c for c in calls if c) == 2 * 64
    assert len([c for c in calls if c]) < len(pieces)  # the two slots' pieces went into shared calls
    for request, seed in zip(requests, (6, 7)):
        assert_parity(model, request, image(seed))


def test_bad_media_are_the_clients_errors(engine):
    model, eng = engine
    with pytest.raises(MediaError, match="could not decode"):
        eng.media.prompt(PROMPT, [MediaInput("image", b"\x89PNG not really", "image/png")])
    with pytest.raises(MediaError, match="markers"):
        eng.media.prompt(PROMPT + MEDIA_MARKER + " x", [image(1)])
    with pytest.raises(MediaError, match="ends with a media item"):
        eng.media.prompt(f"look {MEDIA_MARKER}", [image(1)])
    with pytest.raises(MediaError, match="no audio"):
        eng.media.prompt(PROMPT, [MediaInput("audio", b"RIFF", "audio/wav")])


def test_a_model_without_a_projector_refuses_media(tiny_model):
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=1, max_ctx=256, n_threads=1, n_threads_batch=1))
    try:
        with_projector = Projector(cached_tiny_projector(), model)
        try:
            prompt = build_prompt(with_projector, PROMPT, [image(1)])
        finally:
            with_projector.close()
        with pytest.raises(AdmissionError) as refused:
            engine.submit(Request(prompt.tokens, SamplingParams(max_tokens=2), media=prompt.spans))
        assert refused.value.kind is ErrorKind.INVALID and "--mmproj" in refused.value.message
    finally:
        engine.stop()


def compressed_around(engine, media: MediaInput):
    """PROMPT with eight notes before and after the picture, compressed by PFlash (keep 0.4, the
    model its own drafter): the prompt, the compression's result and the media's span in its tokens."""
    from pflash_plugin.engine.media_prompt import relocated
    from pflash_plugin.pflash.compressor import Compressor, PflashConfig
    from pflash_plugin.pflash.drafter import Drafter, DraftOptions
    from pflash_plugin.pflash.planning import Planner

    model, eng = engine
    notes = " ".join(f"Note {i}: the bridge opens at dawn." for i in range(8))
    text = PROMPT.replace("look at", notes + " look at").replace("the picture", "the picture " + notes)
    prompt = eng.media.prompt(text, [media])
    config = PflashConfig(mode="always", threshold=16, keep_ratio=0.4, segment_min=4, segment_max=16)
    plan = Planner(config, model, True).plan(prompt.tokens, None)
    assert plan.job is not None  # the pseudo-ids are never read as text (Model.piece would refuse them)
    drafter = lambda: Drafter(model, [1], 1024, DraftOptions(n_batch=64))  # noqa: E731
    result = Compressor(config, model.piece, drafter, persistent=False).compress(plan.job)
    [moved] = relocated(prompt.spans, result.tokens)
    return prompt, result, moved


def test_pflash_keeps_the_media_whole_and_scores_the_text_around_them(engine):
    _, eng = engine
    prompt, result, moved = compressed_around(engine, image(1))
    assert result.report.status == "compressed" and len(result.tokens) < len(prompt.tokens) - 60
    [span] = prompt.spans
    assert moved.start < span.start  # text before it was dropped; the run itself is whole
    assert result.tokens[moved.start : moved.end] == prompt.tokens[span.start : span.end]
    assert all(t >= 0 for t in result.tokens[: moved.start] + result.tokens[moved.end :])
    # the engine prefills the compressed prompt, the image's embeddings at its new positions
    request = Request(prompt.tokens, SamplingParams(max_tokens=6, temperature=0.0), prefill_tokens=result.tokens,
                      media=(moved,))
    end = run(eng, [request])[0]
    assert end.reason == "length" and end.usage.media_tokens == 64 and request.n_prefilled == len(result.tokens)


def test_a_pseudo_token_never_reaches_llama_cpps_vocabulary(engine):
    model, eng = engine
    tokens = eng.media.prompt(PROMPT, [image(1)]).tokens
    with pytest.raises(ValueError, match="not in the vocabulary"):  # llama.cpp would abort the process
        model.piece(min(tokens))


def test_the_embedding_cache_keeps_the_recent_images_within_its_bytes(engine):
    from pflash_plugin.engine.media_encoder import MediaEncoder

    model, _ = engine
    one_image = 64 * model.n_embd * 4  # float32 rows of one image's 64 tokens
    encoder = MediaEncoder(Projector(cached_tiny_projector(), model), cache_bytes=2 * one_image)
    try:
        def encode(seed: int) -> np.ndarray:
            spans = encoder.prompt(PROMPT, [image(seed)]).spans
            encoder.want(spans)
            return spans[0].embeddings.result(timeout=30)

        first = encode(1)
        encode(2)
        assert np.array_equal(encode(1), first) and encoder.stats().encoded == 2  # a hit: 1 and 2 fit
        encode(3)  # evicts 2, the least recently used
        encode(1)
        assert encoder.stats().encoded == 3
        encode(2)
        stats = encoder.stats()
        assert stats.encoded == 4 and stats.cache_bytes <= 2 * one_image and stats.cache_hits == 2
    finally:
        encoder.close()


def test_a_chunk_ends_at_a_media_edge_and_the_step_gives_the_rest_to_the_next_prompt():
    from pflash_plugin.engine.step_policy import Seat, StepPolicy

    plan = StepPolicy(max_batch_tokens=64).plan([Seat("a", False, 100, piece_left=13), Seat("b", False, 120)])
    assert plan.chunks == (("a", 13), ("b", 51))  # a's text up to its image; b takes what a could not


def test_several_encoders_encode_the_images_of_several_requests_at_once(tiny_model, monkeypatch):
    """media_encoders 2: two requests' images are inside libmtmd's encode at the same time, each on
    a projector of its own (the barrier lets an encode begin only once the other has begun: with
    one worker it breaks and both requests fail), and each answers as llama.cpp's own path does."""
    config = EngineConfig(n_slots=2, max_ctx=512, n_batch=24, n_ubatch=24, n_threads=1, n_threads_batch=1,
                          mmproj=str(cached_tiny_projector()), media_encoders=2)
    model, eng = load_engine(tiny_model, config)
    try:
        both = threading.Barrier(2, timeout=20)
        for projector in eng.media.projectors:
            monkeypatch.setattr(projector, "encode", lambda chunk, real=projector.encode: (both.wait(), real(chunk))[1])
        requests = [media_request(eng, image(11)), media_request(eng, image(12))]
        assert all(isinstance(end, FinishEvent) for end in run(eng, requests))
        assert [p.encoded for p in eng.media.projectors] == [1, 1]
        stats = eng.media.stats()
        assert stats.encoders == 2 and stats.encoded == 2 and stats.decode_rows >= 2 * 64
        assert stats.decode_calls >= 1 and stats.decode_pieces >= 2
        for request, seed in zip(requests, (11, 12)):
            assert_parity(model, request, image(seed))
    finally:
        eng.stop()
        eng.close()


def test_audio_is_decoded_as_llama_cpps_own_path_decodes_it(tiny_model):
    """A tiny Qwen2-Audio projector (a Whisper encoder: 750 tokens a 30 s window, between the text
    <|audio_bos|> and <|audio_eos|>): the batched engine's greedy tokens and first logprobs after
    a WAV clip equal mtmd_helper_eval_chunks', with the clip decoded in pieces beside a text request."""
    config = EngineConfig(n_slots=2, max_ctx=1024, n_batch=128, n_ubatch=128, n_threads=1, n_threads_batch=1,
                          mmproj=str(cached_tiny_projector(kind="qwen2a")), prefill_chunk=128)
    model, eng = load_engine(tiny_model, config)
    try:
        clip = MediaInput("audio", wav(8000), "audio/wav")
        request = media_request(eng, clip)
        assert request.media[0].chunk.kind == "audio" and request.media[0].chunk.n_tokens == 750
        text = Request(model.tokenize("the water is", True), SamplingParams(max_tokens=12, temperature=0.0))
        assert all(isinstance(end, FinishEvent) for end in run(eng, [request, text]))
        assert eng.media.stats().decode_pieces >= 750 // 128
        assert_parity(model, request, clip, kind="qwen2a")
        with pytest.raises(MediaError, match="takes no image"):
            eng.media.prompt(PROMPT, [image(1)])
    finally:
        eng.stop()
        eng.close()
