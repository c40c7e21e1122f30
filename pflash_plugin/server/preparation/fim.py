"""Fill-in-the-middle prompts, built as llama-server builds /infill's (tools/server/server-common.cpp,
format_prompt_infill), so that a code editor's completion reads the same tokens here:

    [extra] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID          (SPM: FIM_SUF suffix FIM_PRE ...)

`extra` is the repo-level context (arXiv 2409.12186): FIM_REP "myproject\\n", then per chunk
FIM_SEP "<filename>\\n" and its text (a "--- snippet ---" line where the vocabulary has no FIM_SEP),
then FIM_SEP "filename\\n", each part only where the vocabulary has its token. The texts are text:
no BOS of their own, and a control token they spell stays text (llama-server's tokenize_mixed with
add_special and parse_special false); BOS goes before the first FIM token where the model adds one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence, Union

from ...llama.fim import FimTokens
from ..runtime.models import ServedModel
from ..wire.protocol import RequestError

Mixed = Union[str, Sequence[Union[str, int]]]  # llama-server's input_prefix / input_suffix: text, or text and ids
SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's separator of extra chunks where the vocabulary has no FIM_SEP
REPO = "myproject\n"  # llama-server's project name (a TODO there: not an input)
CURRENT_FILE = "filename\n"  # and the current file's
N_PREDICT = -1  # llama-server's default --n-predict, in its room for the extra context


@dataclass(frozen=True)
class FimParts:
    """The tokens around the cursor: `middle` is /infill's `prompt`, the start of the line being
    completed, read after the prefix; `extra` the repo-level context."""

    prefix: list[int]
    suffix: list[int]
    middle: list[int]
    extra: list[int]


def fim_prompt(fim: FimTokens, bos: int | None, parts: FimParts, spm: bool = False) -> list[int]:
    """The prompt's tokens (`bos` None: the model adds none); `spm`: suffix before prefix
    (llama-server's --spm-infill)."""
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None
    head = [fim.pre, *parts.prefix, *parts.middle]
    tail = [fim.suf, *parts.suffix]
    first, second = (tail, head) if spm else (head, tail)
    return [*parts.extra, *([] if bos is None else [bos]), *first, *second, fim.mid]


def trimmed(parts: FimParts, n_batch: int, n_ctx: int) -> FimParts:
    """llama-server's fit of /infill's prompt: the prefix's last 3/4 of a batch, the suffix's start
    in the rest of it (less the middle and two tokens), the extra context's end in what the context
    has beyond a batch. Editors send more than fits and count on this."""
    n_prefix = min(len(parts.prefix), 3 * (n_batch // 4))
    n_suffix = min(len(parts.suffix), max(0, n_batch // 4 - (2 + len(parts.middle))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * N_PREDICT), len(parts.extra))
    return replace(parts, prefix=parts.prefix[len(parts.prefix) - n_prefix:], suffix=parts.suffix[:n_suffix],
                   extra=parts.extra[len(parts.extra) - n_extra:])


def require_fim(served: ServedModel, param: str) -> FimTokens:
    """The model's FIM tokens, or a 400 naming `param` where it lacks one a FIM prompt needs."""
    fim = served.model.fim
    missing = fim.missing()
    if missing:
        raise RequestError(400, f"{param}: this model has no fill-in-the-middle tokens (its vocabulary lacks the "
                           f"{', '.join(missing)} token), so it cannot fill in text before a suffix", param=param)
    return fim


def text_tokens(served: ServedModel, value: Mixed, param: str, add_special: bool = False,
                parse_special: bool = False) -> list[int]:
    """Text (or llama-server's mix of texts and token ids, its tokenize_mixed) as FIM reads it: no
    BOS, control tokens spelled in it left as text; /completion and /tokenize ask for a BOS (before
    a first item of text only) and control tokens parsed. Each id checked against the vocabulary."""
    if isinstance(value, str):
        served.prompts.limit.check_text(value, param)
        return served.model.tokenize(value, add_special=add_special, parse_special=parse_special)
    tokens: list[int] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            served.prompts.limit.check_text(item, f"{param}.{i}")
            tokens += served.model.tokenize(item, add_special=add_special and i == 0, parse_special=parse_special)
        elif not 0 <= item < served.model.n_vocab:
            raise RequestError(400, f"{param}.{i}: token id {item} is outside the vocabulary "
                               f"(0..{served.model.n_vocab - 1})", param=f"{param}.{i}")
        else:
            tokens.append(item)
    return tokens


def extra_tokens(served: ServedModel, fim: FimTokens, chunks: Sequence[tuple[str, str]], param: str) -> list[int]:
    """The repo-level context of (filename, text) chunks, before the FIM prompt."""
    def plain(text: str, where: str) -> list[int]:
        return text_tokens(served, text, where)

    tokens = [fim.rep, *plain(REPO, param)] if fim.rep is not None else []
    for i, (filename, text) in enumerate(chunks):
        tokens += [fim.sep, *plain(filename + "\n", f"{param}.{i}.filename")] if fim.sep is not None \
            else plain(SNIPPET, param)
        tokens += plain(text, f"{param}.{i}.text")
    if fim.sep is not None:
        tokens += [fim.sep, *plain(CURRENT_FILE, param)]
    return tokens


def bos_of(served: ServedModel) -> int | None:
    """The BOS token where the model adds one (llama_vocab_get_add_bos), else None."""
    return served.model.bos if served.model.add_bos else None


def wants_fim(served: ServedModel, suffix: str | None) -> bool:
    """Whether a completion's `suffix` asks for a FIM prompt: any suffix on a model with FIM tokens
    ("" too: the cursor at the end of the file, as llama-server's /infill reads an empty
    input_suffix), a non-empty one on any model (refused by `require_fim`). An empty suffix on a
    model without them leaves nothing to fill before: a plain completion, as stock answers it."""
    return suffix is not None and (bool(suffix) or not served.model.fim.missing())


def completion_prompts(served: ServedModel, prompt: str | list, suffix: str) -> list[tuple[list[int], list[int],
                                                                                           str | None]]:
    """/v1/completions' prompts with a suffix, as (FIM prompt, the prompt's own tokens, its text or
    None for token ids): each prompt is the prefix; the tokens are those llama-server's /infill
    builds for that input_prefix and input_suffix (no input_extra, no prompt), untrimmed (a prompt
    too long for the context is refused as any other)."""
    fim = require_fim(served, "suffix")
    after = text_tokens(served, suffix, "suffix")
    extra = extra_tokens(served, fim, (), "suffix")
    prompts = _prompts(prompt)
    out = []
    for i, one in enumerate(prompts):
        where = "prompt" if one is prompt else f"prompt.{i}"
        before = text_tokens(served, one, where) if isinstance(one, str) else served.prompts.tokenize_prompts(
            one, where)[0][0]
        out.append((fim_prompt(fim, bos_of(served), FimParts(before, after, [], extra), served.settings.spm_infill),
                    before,
                    one if isinstance(one, str) else None))
    return out


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """An OpenAI `prompt` (text, token ids, or a list of either) as its prompts."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
