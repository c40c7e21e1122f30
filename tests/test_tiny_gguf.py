"""Checks that the synthetic tiny GGUF loads in llama.cpp and behaves like a real model."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

from pflash_plugin.llama.tiny_gguf import cached_tiny_llama, tiny_vocab, write_tiny_llama  # noqa: E402 (after the skips)

TEXT = "Hello world, 123!\nnew line"


def _load(path: pathlib.Path) -> "llama_cpp.Llama":
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False)


@pytest.fixture(scope="module")
def tiny() -> pathlib.Path:
    return cached_tiny_llama()


def test_file_is_deterministic(tmp_path: pathlib.Path) -> None:
    a = write_tiny_llama(tmp_path / "a.gguf")
    b = write_tiny_llama(tmp_path / "b.gguf")
    c = write_tiny_llama(tmp_path / "c.gguf", seed=1)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("tiled", [False, True])
def test_the_bias_channel_is_in_the_embeddings_and_bans_in_the_output(tmp_path: pathlib.Path, tiled: bool) -> None:
    """Dim 0 of every embedding is 0.2, and the output rows of control tokens read it with -2 (so
    they are never generated): tiled too, where one array is drawn for both shapes alike."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(write_tiny_llama(tmp_path / "m.gguf", tiled=tiled))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    embd, out = tensors["token_embd.weight"], tensors["output.weight"]
    assert np.all(embd[:, 0] == np.float32(0.2))
    tokens, _, types = tiny_vocab()
    control = [i for i, t in enumerate(types) if t == 3]  # CONTROL
    assert np.all(out[control, 0] == -2.0) and out[tokens.index("Hello"), 0] == 0.0


def test_cache_reuses_file() -> None:
    assert cached_tiny_llama() == cached_tiny_llama()
    assert cached_tiny_llama() != cached_tiny_llama(seed=1)


def test_tokenize_roundtrip(tiny: pathlib.Path) -> None:
    llm = _load(tiny)
    assert llm.n_vocab() == len(tiny_vocab()[0])
    toks = llm.tokenize(TEXT.encode())
    assert toks[0] == llm.token_bos() == 1
    assert llm.detokenize(toks).decode() == TEXT
    assert llm.detokenize(llm.tokenize(TEXT.encode(), add_bos=False)).decode() == TEXT
    # whole words are single tokens; non-ASCII falls back to bytes and still round-trips
    assert len(llm.tokenize(b" the", add_bos=False)) == 1
    odd = "naïve ☃ tab\tend"
    assert llm.detokenize(llm.tokenize(odd.encode(), add_bos=False)).decode() == odd


def test_generation_is_deterministic(tiny: pathlib.Path) -> None:
    outs = []
    for _ in range(2):
        llm = _load(tiny)
        res = llm.create_completion("Hello world", max_tokens=8, temperature=0.0)
        # specials/non-ASCII bytes are suppressed, so generation always runs to the limit
        assert res["usage"]["completion_tokens"] == 8
        assert res["choices"][0]["finish_reason"] == "length"
        assert res["choices"][0]["text"].strip() and res["choices"][0]["text"].isascii()
        outs.append(res["choices"][0]["text"])
    assert outs[0] == outs[1]


def test_chat_template_is_used(tiny: pathlib.Path) -> None:
    llm = _load(tiny)
    assert "<|im_start|>" in llm.metadata["tokenizer.chat_template"]
    res = llm.create_chat_completion(
        [{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    # exactly one BOS: the template has {{ bos_token }}, llama-cpp-python adds none
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    n_prompt = len(llm.tokenize(prompt.encode(), add_bos=True, special=True))
    assert res["usage"]["prompt_tokens"] == n_prompt
    assert res["usage"]["completion_tokens"] == 4


def test_vocab_extra_changes_n_vocab(tmp_path: pathlib.Path) -> None:
    base = _load(cached_tiny_llama()).n_vocab()
    other = _load(write_tiny_llama(tmp_path / "v.gguf", vocab_extra=37)).n_vocab()
    assert other == base + 37
