"""How an engine speculates, from stock's keys: `--draft_model prompt-lookup-decoding` (n-gram drafts,
ngram.py) or `--draft_model PATH.gguf` (a draft model, draft_model.py), `--draft_model_num_pred_tokens`
draft tokens at most per row and step."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ...llama import Model, ModelParams
from ..request import Request
from .draft_model import DraftModelConfig, DraftModelProposer, check_draft_model
from .drafting import Speculation
from .ngram import NgramProposer
from .policy import SpeculationPolicy
from .proposer import Proposer

PROMPT_LOOKUP = "prompt-lookup-decoding"  # stock's value (llama_cpp.llama_speculative.LlamaPromptLookupDecoding)
DRAFT_PFLASH = "pflash"  # the server's: PFlash's drafter GGUF (--pflash_drafter) as the draft model
MAX_NGRAM = 2  # stock's max_ngram_size


@dataclass(frozen=True)
class SpeculationConfig:
    draft: str  # PROMPT_LOOKUP, or the path of a draft model's GGUF
    num_pred_tokens: int = 10  # draft tokens per row and step at most (stock's default)
    max_rows: int = 16  # more rows decoding than this: no speculation (SpeculationPolicy.max_rows)
    # a draft model's load (the target's placement: the server's draft_model_params) and threads (0: llama.cpp's)
    draft_params: ModelParams = ModelParams()
    n_threads: int = 0
    n_threads_batch: int = 0

    def __post_init__(self) -> None:
        if self.num_pred_tokens < 1:
            raise ValueError(f"draft_model_num_pred_tokens must be at least 1, not {self.num_pred_tokens}")

    def max_step_drafts(self, n_slots: int) -> int:
        """Draft tokens one step carries at most: the context's logits rows beyond one per slot."""
        return self.num_pred_tokens * min(n_slots, self.max_rows)


@dataclass(frozen=True)
class DraftModel:
    """A draft model's weights, loaded before the engine is built so that the memory plan can count
    them (server/runtime/assembly.py); `owned`: the proposer closes them with the engine (False:
    PFlash's drafter, loaded once for both jobs, whose owner outlives the engine)."""

    model: Model
    owned: bool = True


def load_draft(config: SpeculationConfig, target: Model) -> DraftModel | None:
    """`config`'s draft model, loaded where its params say and checked against the target's
    vocabulary (refused in one line); None for prompt lookup."""
    if config.draft == PROMPT_LOOKUP:
        return None
    draft = Model(config.draft, config.draft_params)
    try:
        check_draft_model(target, draft)
    except BaseException:
        draft.close()
        raise
    return DraftModel(draft)


def draft_context(n_slots: int, max_ctx: int) -> DraftModelConfig:
    """The draft model's context: one sequence per slot over max_ctx cells shared by the rows
    (unified), as llama-server's -md sizes its draft context like the target's; rows that find it
    full draft nothing until cells free (at max_ctx x the rows, Qwen3-0.6B's KV, 112 KiB a token,
    at 128K tokens and 16 rows: 240 GB)."""
    return DraftModelConfig(slots=n_slots, n_ctx=max_ctx)


def proposer(config: SpeculationConfig, target: Model, n_slots: int, n_ctx: int,
             draft: DraftModel | None = None) -> Proposer:
    """The drafts' source: prompt lookup, or a draft model on its own context (the hook of
    `--draft_model PATH.gguf`: draft_model.DraftModelProposer, sharing the target's vocabulary),
    over `draft` where it was loaded already (else loaded here)."""
    if config.draft == PROMPT_LOOKUP:
        return NgramProposer(MAX_NGRAM, config.num_pred_tokens)
    if draft is None:
        draft = load_draft(config, target)
        assert draft is not None
    else:
        check_draft_model(target, draft.model)
    shape = replace(draft_context(n_slots, n_ctx), n_threads=config.n_threads, n_threads_batch=config.n_threads_batch)
    return DraftModelProposer(draft.model, shape, owns_model=draft.owned)


def speculation(config: SpeculationConfig, target: Model, eligible: Callable[[Request], bool], n_slots: int,
                max_ctx: int, draft: DraftModel | None = None) -> Speculation:
    """The engine's Speculation for `config` (`eligible`: the runner's Sampling.speculates; `draft`:
    its draft model where the server loaded it, or shares PFlash's)."""
    source = proposer(config, target, n_slots, max_ctx, draft)
    policy = SpeculationPolicy(max_draft=config.num_pred_tokens, max_rows=config.max_rows)
    return Speculation(source, policy, eligible, config.max_step_drafts(n_slots))
