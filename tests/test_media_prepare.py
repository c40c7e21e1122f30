"""A media request's way to the engine (issue 46): its preparation on a pool of its own, its time
split in parts in /status (`media`'s prepare_* sums: what bench/vision.py prints per round), and
libmtmd's small calls made holding the GIL (taking it back after a release waits out another
thread's switch interval: a tokenize beside two busy Python threads took 55 ms, 2 ms alone).

These need libmtmd: they FAIL where llama_cpp was built without it, unless PFLASH_NO_MTMD=1."""
from __future__ import annotations

import base64
import os
import threading
import time

import pytest

from pflash_plugin.llama.media import mtmd_available
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector
from pflash_plugin.testing.media_files import png

from conftest import live_server

if os.environ.get("PFLASH_NO_MTMD") == "1" and not mtmd_available():
    pytest.skip("llama_cpp built without libmtmd on purpose (PFLASH_NO_MTMD=1)", allow_module_level=True)

PARTS = ("upload", "parse", "wait", "media", "tokenize", "work", "back")


def image_chat(image: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "what is in the picture"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "vision", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0}


@pytest.fixture(scope="module")
def server():
    model = {"model": str(cached_tiny_llama()), "model_alias": "vision", "mmproj": str(cached_tiny_projector()),
             "n_ctx": 1024, "max_concurrency": 2, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model]) as live:
        yield live


def test_media_chats_are_prepared_on_their_own_pool_and_timed_in_parts(server):
    before = server.status("vision")["media"]
    assert before["prepare_threads"] == 8
    with server.client() as client:
        assert client.post("/v1/chat/completions", json=image_chat(png(24, 20, 1))).status_code == 200
        assert client.post("/v1/chat/completions", json=image_chat(png(336, 336, 2))).status_code == 200
        text = {"model": "vision", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=text).status_code == 200  # not a media chat: not counted
        bad = client.post("/v1/chat/completions", json=image_chat(png(24, 20, 3)[:60]))  # cut past its header
        assert bad.status_code == 400  # refused, and counted
    after = server.status("vision")["media"]
    assert after["prepared"] - before["prepared"] == 3
    spent = {part: after[f"prepare_{part}_s"] - before[f"prepare_{part}_s"] for part in PARTS}
    assert all(seconds >= 0 for seconds in spent.values()) and spent["upload"] > 0 and spent["parse"] > 0, spent
    assert spent["media"] > 0 and spent["tokenize"] > 0 and spent["work"] >= spent["media"] + spent["tokenize"]
    assert spent["tokenize"] == pytest.approx(after["tokenize_s"] - before["tokenize_s"], abs=0.05)
    assert any(t.name.startswith("pflash-media-prepare") for t in threading.enumerate())


def test_tokenize_releases_the_gil_only_for_libmtmd_heavy_calls(monkeypatch):
    """Each release of the GIL costs up to the switch interval to take it back beside a thread that
    runs Python (the engine's, the event loop): only decoding the image and cutting the prompt release
    it; the small calls (getters, frees, the chunk's copy) keep it."""
    import ctypes

    import pflash_plugin.llama.media as media
    from pflash_plugin.llama import Model

    model = Model(str(cached_tiny_llama()))
    projector = media.Projector(str(cached_tiny_projector()), model)
    released: list[str] = []
    for name in dir(media.M):
        function = getattr(media.M, name)
        if name.startswith("mtmd_") and isinstance(function, ctypes._CFuncPtr):
            def spy(*args, _function=function, _name=name):
                released.append(_name)
                return _function(*args)
            monkeypatch.setattr(media.M, name, spy)
    try:
        chunks = projector.tokenize("look <__media__> here", [("image", png(24, 20, 4))])
    finally:
        projector.close()
        model.close()
    assert len(chunks) == 3 and isinstance(chunks[1], media.MediaChunk)
    assert released == ["mtmd_helper_bitmap_init_from_buf_wrapper", "mtmd_tokenize"]
    held = media.Q.mtmd_input_chunk_get_n_tokens
    assert type(held)._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # a PYFUNCTYPE: ctypes keeps the GIL through it


def test_image_rows_are_decoded_once_while_image_chats_keep_arriving():
    """Each arrival may cut a step of long prefill for its first token (Steps.preemptible); a step
    with media pieces is never cut: its token batch's abort would roll back the embedding calls
    that landed before it, and the image's rows would be decoded again."""
    model = {"model": str(cached_tiny_llama()), "model_alias": "vision", "mmproj": str(cached_tiny_projector()),
             "n_ctx": 512, "max_concurrency": 16, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model]) as live:
        before = live.status("vision")["media"]
        results: list[int] = []

        def chat(seed: int) -> None:
            time.sleep(0.003 * seed)  # arriving one after another, while the first ones prefill
            with live.client() as client:
                response = client.post("/v1/chat/completions", json=image_chat(png(64, 64, 100 + seed)))
            results.append(response.status_code)

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        after = live.status("vision")["media"]
    assert results == [200] * 16
    tokens = after["media_tokens"] - before["media_tokens"]
    assert tokens == 16 * 64 and after["decode_rows"] - before["decode_rows"] == tokens
