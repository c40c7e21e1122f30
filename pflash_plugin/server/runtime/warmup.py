"""Start-up warm-up, as llama-server's (`--warmup false` skips the engine's part, as its `--no-warmup`):
what a server's first requests would otherwise pay on their clients' clock.

On an H100 (docs/first_token_cpu.md) mix8's short requests answered in 38-43 ms where they were a
freshly started server's first burst, against 27-32 ms where it had served one before, their bodies
read 22-32 ms into the burst against 9.5-14.4; with the warm-up a fresh server read them at 14-16 ms
(d028491). On this project's CPU the first request imported 26 modules (AnyIO's asyncio backend on
the event loop, numpy.random on the engine thread) and took 58-81 ms against the second's 16-21 ms
(26-53 against 15-24 with the warm-up); a fresh server's first mix8 burst (tiny model, --scale 0.1)
answered its short requests in 344 ms before, 33 ms after.
"""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from ...llama import Model
from ..wire import offload
from .inprocess import Run, Target, random_prompt

CPU_TOKENS = 8  # a CPU has no kernels to load: a prompt that runs prefill and decode once is enough
TIMEOUT_S = 300.0


def warm_engine(served: Target, model: Model, n_tokens: int) -> None:
    """One request through the engine (prefill, two decode steps, sampling, detokenizing), then the
    prefix cache forgets its prompt. On a GPU `n_tokens` is a ubatch (CUDA loads each kernel at its
    first launch, and a full ubatch's matrix kernels are not a decode step's). It drafts nothing: a
    random prompt's rejected drafts would spend speculation's budget (engine/speculation/budget.py)
    before a client's request could."""
    prompt = random_prompt(model, max(n_tokens, 2), seed=0)
    Run(served, prompt, "off", max_tokens=2, speculative=False).wait(TIMEOUT_S)
    served.engine.clear_prefix_cache()


def warmup_tokens(on_gpu: bool, n_ubatch: int, max_ctx: int) -> int:
    """The warm-up prompt's length: a ubatch on a GPU, a few tokens on a CPU, room left to answer."""
    return max(2, min(n_ubatch if on_gpu else CPU_TOKENS, max_ctx - 2))


async def warm_request_path() -> None:
    """The request path's threads started (wire/offload.py), and AnyIO's asyncio backend imported (at
    a first request's first use, starlette's streaming or thread hand-off, it held the event loop while
    20 modules loaded)."""
    offload.start()
    await run_in_threadpool(lambda: None)
