"""Generated sampling and grammar parameters against a real server in a child process: no request
may abort it (a C++ exception through ctypes, an assertion), answer 5xx, or leave it unhealthy.
Bounded here; PFLASH_NATIVE_FUZZ_CASES=2000 runs more (same seed: the first cases are these)."""
from __future__ import annotations

import os

import httpx

from pflash_plugin.testing.native_fuzz import run_fuzz, server_process, vocab_facts

CASES = int(os.environ.get("PFLASH_NATIVE_FUZZ_CASES", "120"))


def test_generated_sampling_and_grammars_never_abort_the_server(tiny_model, tmp_path):
    n_vocab, eog = vocab_facts(tiny_model)
    with server_process(tiny_model, tmp_path / "server.log") as server:
        result = run_fuzz(server, CASES, n_vocab, eog)
        assert result.findings == [], result.findings[:3]
        assert result.sent == CASES
        assert result.statuses[200] >= CASES // 4, result.statuses  # and many get past validation to the engine
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
