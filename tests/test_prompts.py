"""The server's prompt preparation (server/runtime/prompts.py) on the tiny model."""
from __future__ import annotations

from pflash_plugin.llama import Model
from pflash_plugin.server.runtime.prompts import Prompts


def test_token_id_prompts_are_detokenized_only_for_whoever_needs_their_text(tiny_model, monkeypatch):
    """4 prompts of 7K ids took 0.56 s of detokenizing (the GIL held) for an `echo` nobody asked for."""
    model = Model(str(tiny_model), n_gpu_layers=0)
    try:
        prompts = Prompts(model, None, {}, max_ctx=64)
        calls: list[list[int]] = []
        monkeypatch.setattr(model, "detokenize", lambda tokens: calls.append(tokens) or "text")
        assert prompts.tokenize_prompts([[5, 6, 7], [8, 9]]) == [([5, 6, 7], None), ([8, 9], None)]
        assert calls == []
        assert prompts.prompt_text([5, 6, 7], None) == "text" and calls == [[5, 6, 7]]
        assert prompts.prompt_text([5, 6, 7], "given") == "given" and len(calls) == 1
    finally:
        model.close()
