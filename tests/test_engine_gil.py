"""The engine thread's foreign calls that release the GIL (ctypes releases it around every call of a
CDLL's function): on a busy process (the event loop streaming 32 answers, image chats' preparation)
each one waits to take it back, so a decode step makes only the long ones (the decode; on a GPU the
logits' read too, which waits for the device). The end-of-generation check of every row and the KV
cells' removal keep it (llama/held.py), as do a new token's text, a request's sampler chain built and
freed, the logits' read where the decode computed them before returning, and the native sampler over
them: a 32-row decode step made 35 such calls, then 3-4 (bench/vision_steps.py --calls), now 1-2."""
from __future__ import annotations

import ctypes
import threading
from collections import Counter

import llama_cpp.llama_cpp as C
import pytest

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import Request, SamplingParams

from conftest import run_requests


def test_decode_steps_release_the_gil_only_for_long_calls(tiny_model, monkeypatch):
    main = threading.get_ident()
    released: Counter[str] = Counter()
    for name in [n for n in dir(C) if n.startswith("llama_")]:
        function = getattr(C, name)
        if isinstance(function, ctypes._CFuncPtr):
            def spy(*args, _function=function, _name=name):
                if threading.get_ident() != main:
                    released[_name] += 1
                return _function(*args)
            monkeypatch.setattr(C, name, spy)
    config = EngineConfig(n_slots=4, max_ctx=256, n_batch=64, n_threads=1, n_threads_batch=1)
    model, engine = load_engine(tiny_model, config)
    try:
        requests = [Request(model.tokenize(f"the water {i} is", True),
                            SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)) for i in range(4)]
        run_requests(engine, requests)
        steps = engine.steps
    finally:
        engine.stop()
        engine.close()
    assert steps >= 24 and released["llama_decode"] >= 24
    short = ("llama_get_logits", "llama_get_logits_ith",  # on the CPU the decode computed them already
             "llama_vocab_is_eog", "llama_memory_seq_rm", "llama_token_to_piece", "llama_sampler_chain_init",
             "llama_sampler_chain_add", "llama_sampler_init_greedy", "llama_sampler_free")
    assert not any(released[name] for name in short), released
    assert sum(released.values()) <= 2 * steps, (steps, released)



def native_calls():
    """A long call of each native function the engine thread makes every step (256 rows of 128K)."""
    import numpy as np

    from pflash_plugin.llama import native

    logits = np.random.default_rng(0).standard_normal((256, 131072), dtype=np.float32)
    rows = np.zeros(256, dtype=native.SAMPLE_ROW)
    rows["row"] = np.arange(256)
    masks = np.zeros((256, 131072 // 32), dtype=np.int32)  # every token forbidden: a store each
    index = np.arange(256, dtype=np.int64)
    return {"sample_rows": lambda: native.sample_rows(logits, rows, 1),
            "apply_bitmask": lambda: native.apply_bitmask(logits, index, masks, index, 1)}


@pytest.mark.parametrize("name", ["sample_rows", "apply_bitmask"])
def test_the_native_step_calls_keep_the_gil(name):
    """The host sampler and the grammar masks, called every step on the engine thread, keep the GIL:
    a Python thread waiting for it gets nothing during the call (released, the waiting thread runs
    until the switch interval forces it to hand the GIL back, which the engine thread waits for)."""
    import sys
    import time

    from pflash_plugin.llama import native

    if native.load() is None:
        pytest.skip("the native library is not built")
    call = native_calls()[name]
    call()  # warm: pages and the call's binding
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    ticks = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.01)  # the spinner holds the GIL at times; the main thread takes it back
        during = []
        for _ in range(5):
            before = ticks[0]
            call()
            during.append(ticks[0] - before)
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(old)
    assert min(during) == 0, during
