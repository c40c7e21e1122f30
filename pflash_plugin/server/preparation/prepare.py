"""Request bodies -> engine requests: prompts (prompts.py), grammars, sampling parameters and the
PFlash plan (pflash/planning.py), checked before anything reaches the engine. Blocking work: the
routes run it in a thread.

`n` samples of one prompt are n engine requests over the same prompt tokens (the prefix cache and
the KV pool share what they can); sample i of a seeded request uses seed + i, so the samples differ.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from llama_cpp import llama_grammar

from ...chat.reasoning import Reader, for_template, opens_in_prompt, reader_for, requested_tags
from ...chat.switches import THINKING_DEFAULT
from ...chat.tool_calls import GENERIC, ToolCallReader
from ...engine.constraints import prebuild
from ...engine.media_prompt import MediaSpan
from ...engine.reasoning_budget import ReasoningBudget
from ...engine.request import Request as EngineRequest
from ...engine.request import SamplingParams
from ...llama import DRY_TEMPLATES
from ...pflash.planning import MAX_EXPLICIT_QUERY, PlanError, PromptFacts
from ..runtime.generation import Generation
from ..runtime.models import ServedModel
from ..runtime.prompts import ChatPrompt, count_prompts
from ..wire.chat_content import chat_messages
from ..wire.peer_fields import Guide, guide_of
from ..wire.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    PflashOverride,
    RequestError,
    ResponseFormat,
    sampling_params,
)
from ..wire.responses import ChatChoice, CompletionChoice, new_id
from .constraint import Constrained, constrained
from .guided import guided
from .fim import completion_prompts, wants_fim
from .format_cache import format_key, formats
from .lora import refuse_request_scales
from .media import media_tokens
from .schema_bounds import schema_grammar
from .tool_requests import ToolRequest, plain_history


def _samples(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [dataclasses.replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)]


def _max_tokens(requested: int | None, prompt: list[int], served: ServedModel) -> int:
    """None or 0 means: until the context ends, as in llama_cpp."""
    if requested is None or requested <= 0:
        return max(served.max_ctx - len(prompt), 1)
    return requested


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _sample_requests(served: ServedModel, tokens: list[int], params: SamplingParams, n: int,
                     ask: PflashOverride | None, facts: PromptFacts, priority: int = 0,
                     media: tuple[MediaSpan, ...] = ()) -> list[EngineRequest]:
    """The n samples of one prompt, sharing its PFlash plan: one compression job for all of them
    (the engine runs it once and hands its result to each), or the report of why there is none."""
    if ask is not None and ask.query:  # before it is tokenized: 7 MB took 3 s and 430 MB (issue 49)
        served.prompts.limit.check_text(ask.query, "pflash.query", MAX_EXPLICIT_QUERY)
    try:
        plan = served.planner.plan(tokens, ask, facts)
    except PlanError as error:
        raise RequestError(400, str(error), param=error.param) from None
    return [EngineRequest.planned(tokens, sample, plan, priority=priority, media=media)
            for sample in _samples(params, n)]


def _completion_prompts(served: ServedModel, body: CompletionRequest) -> list[tuple[list[int], list[int],
                                                                                    str | None]]:
    """Each prompt as (the tokens the engine reads, the prompt's own tokens, its text or None for
    token ids): with a suffix, a fill-in-the-middle prompt around it (fim.py)."""
    if body.suffix is not None and wants_fim(served, body.suffix):
        return completion_prompts(served, body.prompt, body.suffix)
    prompts = served.prompts.tokenize_prompts(body.prompt)
    _refuse_empty(prompts, body.prompt)
    return [(tokens, tokens, text) for tokens, text in prompts]


def prepare_completion(served: ServedModel, body: CompletionRequest, fill_in: bool = False) -> Generation:
    """`fill_in`: the token-id prompt is a FIM prompt already (/infill's); a `suffix` makes one."""
    refuse_request_scales(served, body.lora)
    n_prompts = count_prompts(body.prompt)  # before tokenizing: 10,000 prompts of 500 characters, +60 MB
    if n_prompts * (body.n or 1) > MAX_N:
        raise RequestError(400, f"{n_prompts} prompts x n={body.n} is over {MAX_N} choices", param="n")
    prompts = _completion_prompts(served, body)
    bias = served.prompts.logit_bias(body.logit_bias, body.logit_bias_type == "tokens")
    grammar = format_grammar(served, body.response_format, body.grammar, guide_of(body))
    facts = PromptFacts(json_format=bool(grammar), fill_in=fill_in or wants_fim(served, body.suffix))
    requests: list[EngineRequest] = []
    choices: list[CompletionChoice] = []
    for tokens, own, text in prompts:
        echo = served.prompts.prompt_text(own, text) if body.echo else ""  # the client's prompt, not a FIM one
        params = sampling_params(body, max_tokens=_max_tokens(body.max_tokens, tokens, served),
                                 logprobs=body.logprobs, grammar=grammar.grammar, logit_bias=bias)
        params.constraint = grammar.constraint
        _check_peer_samplers(served, params)
        _check_untruncated(body.truncate_prompt_tokens, tokens)
        for request in _sample_requests(served, tokens, params, body.n or 1, body.pflash, facts, body.priority):
            requests.append(request)
            choices.append(CompletionChoice(len(choices), served.model.piece, echo,
                                            body.logprobs is not None))
    return Generation(served, requests, choices, "text_completion", "text_completion",
                      sum(len(tokens) for tokens, _, _ in prompts), _include_usage(body), new_id("cmpl"))


def _refuse_empty(prompts: list[tuple[list[int], str | None]], prompt: Any) -> None:
    """An empty prompt (`""` where the model adds no BOS token, `[]`) is a 400 naming the client's
    `prompt` (or its item in a list of prompts), not the engine's refusal, which names no field."""
    empty = next((i for i, (tokens, _) in enumerate(prompts) if not tokens), None)
    if empty is None:
        return
    batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    where = f"prompt.{empty}" if batched else "prompt"
    raise RequestError(400, f"{where}: the prompt is empty (no token to continue from)",
                       param=where)


def _chat_grammar(served: ServedModel, body: ChatCompletionRequest, tools: ToolRequest | None,
                  rendered: ChatPrompt) -> Constrained:
    """A forced tool call's grammar (after what closes a thinking block the prompt opened: the call
    is written outside it); response_format json_object or json_schema (strict or not: the
    grammar enforces the schema either way); otherwise the request's own grammar, if any."""
    forced = tools.grammar(_closing(served, rendered)) if tools else None
    guide = guide_of(body)
    if forced:
        if body.grammar or guide or body.response_format is not None and body.response_format.type != "text":
            raise RequestError(400, "a required or named tool_choice constrains the answer to a tool call: it "
                               "cannot be combined with response_format, grammar or guided decoding",
                               param="tool_choice")
        return constrained(served, forced, "tools")
    return format_grammar(served, body.response_format, body.grammar, guide)


def format_grammar(served: ServedModel, response_format: ResponseFormat | None, grammar: str | None,
                   guide: Guide | None = None) -> Constrained:
    """response_format json_object or json_schema as a constraint (strict or not: it enforces the
    schema either way), for chat and completions alike; a peer's guided decoding (guided.py);
    otherwise the request's own grammar."""
    if guide is not None:
        other = "grammar" if grammar else "response_format" \
            if response_format is not None and response_format.type != "text" else None
        if other:
            raise RequestError(400, f"{other} and {guide.param} both constrain the output: send one",
                               param=guide.param)
        return guided(served, guide)
    if response_format is None or response_format.type == "text":
        return constrained(served, grammar, "grammar")

    def prepared() -> Constrained:
        schema = response_format.schema_for_grammar()
        gbnf = schema_grammar(schema, "response_format") if schema else llama_grammar.JSON_GBNF
        return constrained(served, gbnf, "response_format", schema or None)

    constraint, kept = formats(served).get(format_key(response_format), prepared)
    if kept and constraint.constraint:  # checked before: this request's own matcher, built beside
        prebuild(served.model, constraint.constraint)
    return constraint


def _check_peer_samplers(served: ServedModel, params: SamplingParams) -> None:
    """Stop token ids within the vocabulary; DRY's breakers found here rather than on the engine
    thread (a pass over the vocabulary: DRY_TEMPLATES)."""
    served.prompts.token_ids(sorted(params.stop_token_ids), "stop_token_ids")
    if params.dry is not None:
        DRY_TEMPLATES.warm(served.model, params.dry)


def _check_untruncated(limit: int | None, tokens: list[int]) -> None:
    """vLLM's truncate_prompt_tokens where it cuts nothing; a prompt it would cut is a 400 (a prompt
    cut from the left loses its template's start and this server's PFlash spans and media places)."""
    if limit is not None and limit >= 0 and len(tokens) > limit:
        raise RequestError(400, f"truncate_prompt_tokens: the prompt is {len(tokens):,} tokens, over {limit:,}; "
                           "cutting it is not served here: send a shorter prompt", param="truncate_prompt_tokens")


def _reader(tools: ToolRequest | None) -> ToolCallReader | None:
    """A choice's reader of the tool calls the model writes (none when the request has no tools)."""
    return tools.reader() if tools else None


def _render(served: ServedModel, body: ChatCompletionRequest, tools: ToolRequest | None) -> ChatPrompt:
    """The conversation through the chat template, with the tools unless tool_choice is none."""
    served.prompts.limit.check_turns(len(body.messages), "messages", "messages")  # before any is converted
    converted, sources = chat_messages(body.messages)
    media = served.media.read(sources)  # each item checked, decoded (or fetched) before the template runs
    messages = for_template(converted, served.think_tags)
    served.prompts.limit.check_messages(messages)  # before the template joins them
    switches = _template_kwargs(served, body)
    if tools is not None and tools.syntax.renders_tools:
        return served.prompts.render_chat(messages, tools.tools, body.tool_choice, template_kwargs=switches,
                                          media=media)
    if tools is not None:  # the system prompt describes them: a template's own format would be one we cannot read
        return served.prompts.render_chat(tools.messages(messages), template_kwargs=switches, media=media)
    plain = served.prompts.tool_syntax is GENERIC  # earlier calls as text, if the template takes none
    return served.prompts.render_chat(plain_history(messages) if plain else messages, template_kwargs=switches,
                                      media=media)


def _template_kwargs(served: ServedModel, body: ChatCompletionRequest) -> dict[str, Any]:
    """The request's template variables over the server's, over llama-server's default thinking
    switch where the template has thinking markers."""
    default = THINKING_DEFAULT if served.template_tags is not None else {}
    return {**default, **(served.settings.chat_template_kwargs or {}), **body.template_kwargs()}


PROMPT_TAIL_TOKENS = 24  # the prompt's end that says whether it opened a thinking block


def _reasoning(served: ServedModel, body: ChatCompletionRequest, rendered: ChatPrompt) -> Reader | None:
    """A choice's reader of the thinking the model writes (none where the template has no markers);
    it starts inside the block when the prompt opened it (Qwen3.5 thinking, DeepSeek R1)."""
    tags = requested_tags(served.template_tags, body.reasoning_format or served.settings.reasoning_format)
    if tags is None:
        return None
    return reader_for(tags, _tail(served, rendered))


def _closing(served: ServedModel, rendered: ChatPrompt) -> str:
    """What closes the thinking block the prompt opened ("" where it opened none)."""
    tags = served.think_tags
    if tags is None or tags.channels:
        return ""
    return f"{tags.close}\n\n" if opens_in_prompt(tags, _tail(served, rendered)) else ""


def _tail(served: ServedModel, rendered: ChatPrompt) -> str:
    """The prompt's last tokens as text (a media item's pseudo-tokens, negative ids, left out)."""
    return served.model.detokenize([t for t in rendered.tokens[-PROMPT_TAIL_TOKENS:] if t >= 0])


def _budget(served: ServedModel, tokens: int | None, rendered: ChatPrompt,
            grammar: Constrained) -> ReasoningBudget | None:
    """The thinking's budget, where the request sets one and the prompt opened the thinking block
    (a model that opens it itself may not think at all: the closing tag would land in its answer);
    none under a grammar, which decides every token (a forced call closes the block first)."""
    if tokens is None or grammar:
        return None
    closing = _closing(served, rendered)
    if not closing or served.think_tags is None:
        return None
    written = served.model.tokenize(closing, add_special=False, parse_special=True)
    return ReasoningBudget(tokens, served.think_tags.close, tuple(written))


def chat_prompt(served: ServedModel, body: ChatCompletionRequest) -> tuple[ToolRequest | None, ChatPrompt]:
    """The request's tools as served, and its conversation as the model reads it."""
    if not body.messages:
        raise RequestError(400, "messages must contain at least one message", param="messages")
    tools = ToolRequest.of(body, served.prompts.tool_syntax)
    return tools, media_tokens(served, _render(served, body, tools))


def prepare_chat(served: ServedModel, body: ChatCompletionRequest) -> Generation:
    refuse_request_scales(served, body.lora)
    tools, rendered = chat_prompt(served, body)
    grammar = _chat_grammar(served, body, tools, rendered)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        body,
        max_tokens=_max_tokens(body.max_tokens, rendered.tokens, served),
        logprobs=top,
        grammar=grammar.grammar,
        logit_bias=served.prompts.logit_bias(body.logit_bias, body.logit_bias_type == "tokens"),
    )
    params.constraint = grammar.constraint
    _check_peer_samplers(served, params)
    _check_untruncated(body.truncate_prompt_tokens, rendered.tokens)
    params.stop = params.stop + [s for s in rendered.stop if s not in params.stop]
    params.reasoning_budget = _budget(served, body.thinking_budget_tokens, rendered, grammar)
    facts = PromptFacts(rendered.last_user, rendered.system, has_tools=bool(body.tools or body.functions),
                        json_format=bool(grammar))
    requests = _sample_requests(served, rendered.tokens, params, body.n or 1, body.pflash, facts, body.priority,
                                rendered.spans)
    choices = [ChatChoice(i, served.model.piece, bool(body.logprobs), _reader(tools),
                          _reasoning(served, body, rendered)) for i in range(len(requests))]
    return Generation(served, requests, choices, "chat.completion", "chat.completion.chunk",
                      len(rendered.tokens), _include_usage(body), new_id("chatcmpl"))
