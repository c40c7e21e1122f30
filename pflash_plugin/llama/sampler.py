"""A per-request llama.cpp sampler chain built from OpenAI-style parameters."""
from __future__ import annotations

import random
from typing import Mapping

import llama_cpp.llama_cpp as C

from .context import Context
from .model import Model


class GrammarError(ValueError):
    pass


class SamplerChain:
    """grammar -> logit bias -> penalties -> top-k -> typical -> top-p -> min-p -> temp -> dist
    (or temp -> mirostat v1/v2). Temperature <= 0 means greedy. The chain owns its samplers; `close` frees all of them.
    """

    def __init__(
        self,
        model: Model,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        typical_p: float,
        seed: int | None,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        penalty_last_n: int = 64,
        logit_bias: Mapping[int, float] | None = None,
        grammar: str | None = None,
        mirostat: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
    ) -> None:
        params = C.llama_sampler_chain_default_params()
        params.no_perf = True
        self.ptr = C.llama_sampler_chain_init(params)
        try:
            if grammar:
                sampler = C.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
                if not sampler:
                    raise GrammarError("the grammar could not be parsed (GBNF with a 'root' rule expected)")
                self._add(sampler)
            if logit_bias:
                biases = (C.llama_logit_bias * len(logit_bias))()
                for i, (token, bias) in enumerate(logit_bias.items()):
                    model.check_token(token)
                    biases[i].token, biases[i].bias = token, bias
                self._add(C.llama_sampler_init_logit_bias(model.n_vocab, len(logit_bias), biases))
            if repeat_penalty != 1.0 or frequency_penalty or presence_penalty:
                self._add(
                    C.llama_sampler_init_penalties(
                        model.n_vocab,
                        penalty_last_n, repeat_penalty, frequency_penalty, presence_penalty
                    )
                )
            if temperature <= 0:
                self._add(C.llama_sampler_init_greedy())
                return
            seed = seed if seed is not None else random.getrandbits(32)
            if mirostat in (1, 2):  # mirostat replaces the truncation samplers, as in llama.cpp
                self._add(C.llama_sampler_init_temp(temperature))
                self._add(
                    C.llama_sampler_init_mirostat(model.n_vocab, seed, mirostat_tau, mirostat_eta, 100)
                    if mirostat == 1
                    else C.llama_sampler_init_mirostat_v2(seed, mirostat_tau, mirostat_eta)
                )
                return
            if top_k > 0:
                self._add(C.llama_sampler_init_top_k(top_k))
            if typical_p < 1.0:
                self._add(C.llama_sampler_init_typical(typical_p, 1))
            if top_p < 1.0:
                self._add(C.llama_sampler_init_top_p(top_p, 1))
            if min_p > 0.0:
                self._add(C.llama_sampler_init_min_p(min_p, 1))
            self._add(C.llama_sampler_init_temp(temperature))
            self._add(C.llama_sampler_init_dist(seed))
        except BaseException:
            self.close()
            raise

    def _add(self, sampler) -> None:
        C.llama_sampler_chain_add(self.ptr, sampler)

    def sample(self, ctx: Context, index: int) -> int:
        """Sample from batch row `index` and accept the token (penalties, grammar state)."""
        return C.llama_sampler_sample(self.ptr, ctx.ptr, index)

    def close(self) -> None:
        if self.ptr:
            C.llama_sampler_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()
