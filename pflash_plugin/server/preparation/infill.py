"""llama-server's /infill request -> the engine's: its FIM prompt (fim.py), trimmed as llama-server
trims it, run as a completion of those tokens."""
from __future__ import annotations

from ..runtime.generation import Generation
from ..runtime.models import ServedModel
from ..wire.infill import InfillRequest
from .fim import FimParts, bos_of, extra_tokens, fim_prompt, require_fim, text_tokens, trimmed
from .native import native_choices
from .prepare import prepare_completion


def infill_tokens(served: ServedModel, body: InfillRequest) -> list[int]:
    """The prompt llama-server builds for this body: `prompt` read as a prompt is (control tokens
    it spells are tokens), the other texts as text; the whole fitted to a batch and the context."""
    fim = require_fim(served, "input_suffix")
    served.prompts.limit.check_text(body.prompt, "prompt")
    parts = FimParts(prefix=text_tokens(served, body.input_prefix, "input_prefix"),
                     suffix=text_tokens(served, body.input_suffix, "input_suffix"),
                     middle=served.model.tokenize(body.prompt, add_special=False, parse_special=True),
                     extra=extra_tokens(served, fim, [(c.filename, c.text) for c in body.input_extra],
                                        "input_extra"))
    fitted = trimmed(parts, served.plan.engine.n_batch, served.max_ctx)
    return fim_prompt(fim, bos_of(served), fitted, served.settings.spm_infill)


def prepare_infill(served: ServedModel, body: InfillRequest) -> tuple[list[int], Generation | None]:
    """The FIM prompt, and its generation (None for n_predict 0: an empty answer, nothing to run)."""
    tokens = infill_tokens(served, body.checked())
    if body.n_predict == 0:
        return tokens, None
    generation = native_choices(prepare_completion(served, body.completion(tokens), fill_in=True), False,
                                body.n_probs > 0)
    limits = body.line_limits()
    for request in generation.requests if limits else ():
        request.line_limits = limits
    return tokens, generation
