"""A llama.cpp context: decode and its outputs (logits, sampled tokens, embeddings), with its KV
memory per sequence as `Context.memory` (llama/memory.py)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import llama_cpp.llama_cpp as C

from .batch import Batch
from .held import holding_gil
from .log import hush
from .memory import Memory
from .model import Model


_perf_context = holding_gil(C.llama_perf_context)  # a copy of a few counters: microseconds
# the outputs' pointers where the decode computed them before it returned (the output layer not on a
# GPU): no wait inside, so no GIL released (llama/held.py) for the engine thread to wait back for
_get_logits_held = holding_gil(C.llama_get_logits)
_get_logits_ith_held = holding_gil(C.llama_get_logits_ith)


class Decodable(Protocol):
    """What llama_decode takes: a token Batch, or media.EmbeddingBatch's embedding rows."""

    n_tokens: int
    raw: Any


# llama.cpp's backend sampling entry point, which llama_cpp.llama_cpp does not bind:
# bool llama_set_sampler(struct llama_context * ctx, llama_seq_id seq_id, struct llama_sampler * smpl)
_set_sampler = C._lib.llama_set_sampler
_set_sampler.argtypes = [C.llama_context_p_ctypes, C.llama_seq_id, C.llama_sampler_p_ctypes]
_set_sampler.restype = ctypes.c_bool


class DecodeError(RuntimeError):
    """llama_decode failed; `code` is its return value (1: no free KV cells, 2: aborted, <0: error)."""

    def __init__(self, code: int) -> None:
        reason = {1: "no free KV cells", 2: "aborted"}.get(code, "llama.cpp error")
        super().__init__(f"llama_decode returned {code} ({reason})")
        self.code = code


@dataclass
class ContextConfig:
    n_ctx: int
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_outputs_max: int = 0  # logits rows per ubatch (0: n_batch); sizes the output buffers
    n_outputs_max_per_seq: int = 1  # llama.cpp's default (0: n_outputs_max); 1 lets device sampler chains penalize
    n_threads: int = 0  # 0: llama.cpp's default
    n_threads_batch: int = 0
    kv_unified: bool = True
    swa_full: bool = True  # whole-context SWA cells; False: ~n_swa per sequence (reuse only near its end)
    flash_attn: bool | None = None  # None: llama.cpp decides
    offload_kqv: bool = True
    type_k: int | None = None
    type_v: int | None = None
    embeddings: bool = False


class Context:
    def __init__(self, model: Model, config: ContextConfig, eval_callback: Any = None,
                 eval_callback_data: Any = None) -> None:
        params = C.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = config.n_batch
        params.n_ubatch = min(config.n_ubatch, config.n_batch)
        params.n_seq_max = config.n_seq_max
        params.n_outputs_max = config.n_outputs_max
        params.n_outputs_max_per_seq = config.n_outputs_max_per_seq
        if config.n_threads > 0:
            params.n_threads = config.n_threads
        if config.n_threads_batch > 0:
            params.n_threads_batch = config.n_threads_batch
        params.kv_unified = config.kv_unified
        params.swa_full = config.swa_full
        if config.flash_attn is not None:
            params.flash_attn_type = 1 if config.flash_attn else 0
        params.offload_kqv = config.offload_kqv
        if config.type_k is not None:
            params.type_k = config.type_k
        if config.type_v is not None:
            params.type_v = config.type_v
        params.embeddings = config.embeddings
        model.params.rope.apply(params)  # the model's rope, whoever makes a context of it
        params.no_perf = True
        # the callback object must outlive the context, or llama.cpp calls freed memory
        self._eval_callback, self._eval_callback_data = eval_callback, eval_callback_data
        if eval_callback is not None:
            params.cb_eval = eval_callback
            params.cb_eval_user_data = eval_callback_data
        self.model = model
        self.config = config
        self.ptr = C.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise MemoryError(
                f"llama.cpp could not create a context of {config.n_ctx} tokens "
                f"for {config.n_seq_max} sequences (out of memory?)"
            )
        self._apply_loras()
        self.n_ctx: int = C.llama_n_ctx(self.ptr)
        self.n_batch = config.n_batch
        self.n_ubatch: int = C.llama_n_ubatch(self.ptr)
        self.memory = Memory(self.ptr)  # the sequences' KV cells
        self.n_threads: int = C.llama_n_threads(self.ptr)
        self.n_threads_batch: int = C.llama_n_threads_batch(self.ptr)
        self._threads_now = (self.n_threads, self.n_threads_batch)
        self._aborting = False  # the abort callback asked to abort the decode in flight
        self._abort: Any = None  # the abort callback (set_abort), kept referenced while llama.cpp holds it
        self._abort_armed = False  # whether llama.cpp polls it (arm_abort)
        self._outputs_wait = model.output_on_gpu  # reading the outputs waits for the device

    def _apply_loras(self) -> None:
        """The model's LoRA adapters, on this context as on every other context of the model."""
        if not self.model.loras:
            return
        adapters = (C.llama_adapter_lora_p_ctypes * len(self.model.loras))(*(a for a, _ in self.model.loras))
        scales = (ctypes.c_float * len(self.model.loras))(*(s for _, s in self.model.loras))
        if C.llama_set_adapters_lora(self.ptr, adapters, len(self.model.loras), scales) != 0:
            self.close()
            raise ValueError(f"llama.cpp could not apply the LoRA adapters {self.model.params.loras}")

    def close(self) -> None:
        if self.ptr:
            C.llama_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()

    def set_abort(self, should_abort: Callable[[], bool]) -> None:
        """llama.cpp polls this while it computes; True aborts the decode (code 2), dropping the
        ubatch being computed. Kept referenced: llama.cpp holds only the C pointer."""
        def poll(_data: Any) -> bool:
            if should_abort():
                self._aborting = True
                return True
            return False

        self._abort = C.ggml_abort_callback(poll)
        C.llama_set_abort_callback(self.ptr, self._abort, None)
        self._abort_armed = True

    def arm_abort(self, armed: bool) -> None:
        """Whether llama.cpp polls the abort callback (`set_abort`) in the next decodes. It polls after
        every node that the CPU computes, each poll a call into Python that takes the GIL inside
        llama_decode (waiting its turn while another thread holds it): about 800 a decode step of the
        demo model on the CPU, and on a GPU one, after the token rows are gathered on the CPU, before
        the device's graph is launched. A step that nothing may abort need not pay them."""
        if self._abort is None or armed == self._abort_armed:
            return
        C.llama_set_abort_callback(self.ptr, self._abort if armed else C.ggml_abort_callback(), None)
        self._abort_armed = armed

    def use_threads(self, n_threads: int, n_threads_batch: int) -> None:
        """The thread counts of the next decodes: llama.cpp runs a ubatch of one token on
        n_threads, one of 2+ tokens on n_threads_batch."""
        if (n_threads, n_threads_batch) != self._threads_now:
            C.llama_set_n_threads(self.ptr, n_threads, n_threads_batch)
            self._threads_now = (n_threads, n_threads_batch)

    @property
    def host_threads(self) -> int:
        """Threads for the host's passes over the last decode's outputs (sampling's argmax and draws,
        grammar masks): as many as that decode ran its batch on (`use_threads`), whose CPU is free
        while the step's outputs are sampled. On a GPU that is the wide count (engine/threads.py keeps
        it there): the argmax of 64 rows of 128K logits, fresh from the device in host memory, reads
        32 MB, as fast as the cores reading it can; on the CPU the count measured fastest under the
        current load."""
        return self._threads_now[1]

    def decode(self, batch: Batch | Decodable) -> None:
        if batch.n_tokens > self.n_batch:
            raise ValueError(f"{batch.n_tokens} tokens exceed n_batch {self.n_batch}")
        self._aborting = False
        hush(self._aborted_on_request)  # an abort we asked for is no error in the log
        try:
            code = C.llama_decode(self.ptr, batch.raw)
        finally:
            hush(None)
        if code != 0:
            raise DecodeError(code)

    def _aborted_on_request(self) -> bool:
        return self._aborting

    def logits(self, index: int) -> np.ndarray:
        """Logits row of batch token `index` (a copy: the next decode overwrites the buffer)."""
        get = C.llama_get_logits_ith if self._outputs_wait else _get_logits_ith_held
        return np.ctypeslib.as_array(get(self.ptr, index), shape=(self.model.n_vocab,)).copy()

    def output_logits(self, n_outputs: int) -> np.ndarray:
        """The last decode's logits, [n_outputs, n_vocab] in the batch order of the tokens that asked
        for them: a view of llama.cpp's buffer, valid until the next decode (no copy). On a GPU the
        call waits for the device, releasing the GIL; elsewhere they are there already."""
        get = C.llama_get_logits if self._outputs_wait else _get_logits_held
        return np.ctypeslib.as_array(get(self.ptr), shape=(n_outputs, self.model.n_vocab))

    def set_sampler(self, seq_id: int, chain: Any) -> bool:
        """Sample `seq_id`'s outputs inside the decode with this llama.cpp sampler chain (None: stop),
        so that only the token leaves the device. llama.cpp keeps the pointer: the caller keeps the
        chain alive until it sets another or None. Each change rebuilds the scheduler's graphs at
        the next decode. False: the chain cannot run there (llama.cpp samples nothing for it)."""
        return bool(_set_sampler(self.ptr, seq_id, chain))

    def sampled_token(self, index: int) -> int:
        """The token the device chain sampled for batch token `index` of the last decode (-1: none)."""
        return int(C.llama_get_sampled_token_ith(self.ptr, index))

    def embeddings_seq(self, seq_id: int, n_embd: int) -> np.ndarray | None:
        ptr = C.llama_get_embeddings_seq(self.ptr, seq_id)
        if not ptr:
            return None
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()

    def embeddings_ith(self, index: int, n_embd: int) -> np.ndarray:
        ptr = C.llama_get_embeddings_ith(self.ptr, index)
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()

    def graph_reuses(self) -> int:
        """Ubatches llama.cpp computed on the previous ubatch's graph, not a new one, so far (held:
        the engine thread reads it around each decode)."""
        return int(_perf_context(self.ptr).n_reused)

    def synchronize(self) -> None:
        """Wait for the computation llama_decode queued (a GPU decode returns before it ends)."""
        C.llama_synchronize(self.ptr)
