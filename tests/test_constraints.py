"""Structured output with llguidance (engine/constraints.py): the masks of a step's constrained rows
filled together and applied on the host batch path, beside plain rows that they leave alone; no
clock in any of it; GBNF that llguidance cannot read served by llama.cpp's grammar sampler."""
from __future__ import annotations

import json
import sys
import threading
import time

import httpx
import pytest
from llama_cpp import llama_grammar

from pflash_plugin.engine.constraint_masks import ConstraintCounts
from pflash_plugin.engine.constraints import PREBUILT, compile_gbnf, compile_schema
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import ErrorEvent, FinishEvent, Request, SamplingParams

from conftest import live_server
from conftest import run_requests as run  # submitted together (admitted in one step); each one's end event

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
LIST_GBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [1-9] [0-9]{0,2}'
AMBIGUOUS = 'root ::= r "x"\nr ::= "a" r "b" | "a" r "c" | "a"'  # llama.cpp's parse stacks grow 4x a token


def mixed(model, constrained: bool, lengths: list[int] | None = None) -> list[Request]:
    """Two constrained rows (a JSON schema greedy, a GBNF list sampled with a seed) and two plain
    rows (greedy, seeded): unconstrained, the first two run to `lengths` (the constrained run's)."""
    params = [SamplingParams(max_tokens=48, temperature=0, constraint=compile_schema(PERSON)),
              SamplingParams(max_tokens=48, temperature=0.9, seed=7, constraint=compile_gbnf(LIST_GBNF)),
              SamplingParams(max_tokens=20, temperature=0),
              SamplingParams(max_tokens=20, temperature=0.8, seed=11)]
    if not constrained:
        assert lengths is not None
        params[0] = SamplingParams(max_tokens=lengths[0], temperature=0)
        params[1] = SamplingParams(max_tokens=lengths[1], temperature=0.9, seed=7)
    prompts = ["Person:", "Numbers:", "hello there", "the weather"]
    return [Request(model.tokenize(prompt), p) for prompt, p in zip(prompts, params)]


def test_mixed_rows_in_one_batch_constrained_rows_follow_their_grammars_plain_rows_unchanged(tiny_model):
    """The masks apply to their rows only: the plain rows' tokens equal those of a run where the
    same rows decode beside the same requests unconstrained for as many tokens (same batch
    shapes at every step, so the same numerics)."""
    config = EngineConfig(n_slots=4, max_ctx=256, n_threads=1, n_threads_batch=1)
    model, engine = load_engine(tiny_model, config)
    try:
        requests = mixed(model, constrained=True)
        ends = run(engine, requests)
        texts = [model.detokenize(r.output_tokens) for r in requests]
    finally:
        engine.stop()
    assert all(isinstance(ends[r.request_id], FinishEvent) for r in requests), ends
    person = json.loads(texts[0])
    assert set(person) == {"name", "age", "ok"} and isinstance(person["age"], int) and len(person["name"]) <= 6
    numbers = json.loads(texts[1])
    assert isinstance(numbers, list) and all(isinstance(n, int) and 0 <= n < 1000 for n in numbers)
    model, engine = load_engine(tiny_model, config)
    try:
        lengths = [len(requests[0].output_tokens), len(requests[1].output_tokens)]
        plain = mixed(model, constrained=False, lengths=lengths)
        run(engine, plain)
    finally:
        engine.stop()
    assert [r.output_tokens for r in plain[2:]] == [r.output_tokens for r in requests[2:]]
    assert plain[0].output_tokens != requests[0].output_tokens  # the tiny model writes no JSON by itself


def test_the_constraint_path_has_no_clock(tiny_model, monkeypatch):
    """No bound of the constrained path reads a clock: with every CPU-time reading 10 s later than
    the last (a machine as loaded as it gets), the schema request finishes, and so does the
    ambiguous grammar whose parse stacks grow 4x a token in llama.cpp (llguidance's Earley parse
    does not). llama.cpp's grammar sampler, whose guard reads CPU time, ends the same grammar."""
    clock = iter(range(0, 10**9, 10))
    monkeypatch.setattr(time, "thread_time", lambda: float(next(clock)))
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=3, max_ctx=256, n_threads=1, n_threads_batch=1))
    try:
        a = model.tokenize("a", add_special=False)[-1]
        schema = Request(model.tokenize("Person:"), SamplingParams(max_tokens=48, temperature=0,
                                                                    constraint=compile_schema(PERSON)))
        guided = Request(model.tokenize("hi"), SamplingParams(max_tokens=40, temperature=0, logit_bias={a: 100.0},
                                                               constraint=compile_gbnf(AMBIGUOUS)))
        chained = Request(model.tokenize("hi"), SamplingParams(max_tokens=40, temperature=0, logit_bias={a: 100.0},
                                                                grammar=AMBIGUOUS))
        ends = run(engine, [schema, guided, chained])
    finally:
        engine.stop()
    assert isinstance(ends[schema.request_id], FinishEvent), ends[schema.request_id]
    assert set(json.loads(model.detokenize(schema.output_tokens))) == {"name", "age", "ok"}
    assert isinstance(ends[guided.request_id], FinishEvent) and len(guided.output_tokens) == 40
    assert model.detokenize(guided.output_tokens).startswith("a" * 30)
    assert isinstance(ends[chained.request_id], ErrorEvent)


@pytest.fixture(scope="module")
def server(tiny_model):
    with live_server([{"model": str(tiny_model), "max_concurrency": 4, "n_ctx": 512, "n_threads": 1,
                       "n_threads_batch": 1}]) as live:
        yield live


def test_a_gbnf_llguidance_cannot_read_is_served_by_llama_cpps_grammar(server, tiny_model):
    """A token reference (`<[id]>`) is GBNF that llama.cpp reads and llguidance's converter does
    not: the request falls back to llama.cpp's grammar sampler and is answered as it says."""
    token = httpx.post(server.url + "/extras/tokenize", json={"input": "hello"}, timeout=10).json()["tokens"][-1]
    grammar = f'root ::= "x" <[{token}]>'
    with pytest.raises(ValueError):
        compile_gbnf(grammar)
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "temperature": 0,
                                                              "grammar": grammar}, timeout=60)
    assert answer.status_code == 200, answer.text
    detok = httpx.post(server.url + "/extras/detokenize", json={"tokens": [token]}, timeout=10).json()["text"]
    assert answer.json()["choices"][0]["text"] == "x" + detok


def test_a_grammar_neither_engine_reads_is_a_400_naming_the_field(server):
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                              "grammar": 'root ::= "a" undefined-rule'}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "grammar", answer.text


def test_json_schema_over_http_is_valid_json_from_four_clients_at_once(server):
    """A pydantic-style response_format from four clients together: each answer parses."""
    body = {"messages": [{"role": "user", "content": "a person"}], "max_tokens": 60, "temperature": 0.7,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    answers: list[httpx.Response] = []

    def ask(seed: int) -> None:
        answers.append(httpx.post(server.url + "/v1/chat/completions", json={**body, "seed": seed}, timeout=120))

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert set(json.loads(answer.json()["choices"][0]["message"]["content"])) == {"name", "age", "ok"}


def test_status_counts_the_constraint_phases_of_a_schema_request(server):
    """/status's `constraints`: sums since start of the phases that bench/constrained.py splits a
    step into (issue 49: where an H200 step of schema rows goes); one request's share of them."""
    def counts() -> dict:
        return next(iter(httpx.get(server.url + "/status", timeout=10).json()["models"].values()))["constraints"]

    before = counts()
    answer = httpx.post(server.url + "/v1/completions", json={
        "prompt": "a person:", "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, timeout=60)
    assert answer.status_code == 200, answer.text
    after = counts()
    tokens = answer.json()["usage"]["completion_tokens"]
    grew = {key: after[key] - before[key] for key in after}
    assert grew["binds_prebuilt"] == 1 and grew["binds"] == 0  # built where the route checked it
    assert grew["fills_due"] >= tokens and grew["rows_filled"] >= tokens and grew["fills_ahead"] == 0  # the CPU: serial
    assert grew["rows_masked"] + grew["rows_forced"] >= tokens and grew["commits"] >= tokens and grew["commit_s"] > 0
    assert 0 < grew["rows_forced"] < tokens  # a key's or a bracket's token: no mask, no sampler
    assert after["fill_threads"] >= 1 and grew["dense_rows"] <= grew["rows_filled"]
    assert grew["logits_waits"] >= tokens and grew["sample_s"] > 0


def test_a_checked_constraints_matcher_is_the_one_the_engine_binds(tiny_model):
    """The route's check builds the matcher (on its thread, beside the engine), and the engine's bind
    takes it instead of building another on the engine thread; one request per check; bounded."""
    from pflash_plugin.engine.constraints import Constraints, Prebuilt, check_constraint
    from pflash_plugin.engine.loader import load_model

    model = load_model(tiny_model, EngineConfig(n_slots=1, max_ctx=256))
    grammar = compile_schema(PERSON)
    check_constraint(model, grammar)
    constraints = Constraints(model)
    constraints.bind(0, grammar)
    assert (constraints.counts.binds_prebuilt, constraints.counts.binds) == (1, 0)
    constraints.bind(1, grammar)  # no check for this one: built here
    assert (constraints.counts.binds_prebuilt, constraints.counts.binds) == (1, 1)
    constraints.masks.fill([0, 1])
    assert constraints.masks.allowed(0).tolist() == constraints.masks.allowed(1).tolist()  # both fresh: '{' alone
    pool, other = Prebuilt(limit=2), compile_gbnf(LIST_GBNF)
    for text in (grammar, other, other):
        pool.put(model, text, constraints._matchers[0])
    assert pool.take(model, grammar) is None and pool.take(model, other) is not None  # the oldest went


def test_llama_grammar_json_still_converts():
    """json_object without a schema: llama_cpp's JSON grammar through the converter."""
    assert compile_gbnf(llama_grammar.JSON_GBNF)


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "numpy"])
def test_masks_leave_exactly_the_allowed_tokens(native_on, monkeypatch):
    """Both ways of applying llguidance's bitmasks (ggml_ext/mask_cpu.cpp, numpy) leave each
    row's allowed logits as they were and every other one at -inf, a vocabulary not a multiple of
    32 included; rows other than the masked ones untouched."""
    import numpy as np

    from pflash_plugin.engine import constraint_masks
    from pflash_plugin.llama import native

    if native_on and native.load() is None:
        pytest.skip("the native library is not built")
    if not native_on:
        monkeypatch.setattr(native, "apply_bitmask", lambda *args: False)
    rng = np.random.default_rng(1)
    n_vocab = 1000
    masks = rng.integers(-2**31, 2**31 - 1, size=(3, (n_vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    masks[1, :20] = 0
    masks[2] = -1
    engine = constraint_masks.ConstraintMasks(n_vocab, {}, constraint_masks.ConstraintCounts())
    engine._masks, engine._filled = masks, {7: 0, 8: 1, 9: 2}
    logits = rng.random((5, n_vocab), dtype=np.float32)
    before = logits.copy()
    engine.mask_rows(logits, [(7, 3), (8, 0), (9, 1)], n_threads=2)
    for slot, row in [(7, 3), (8, 0), (9, 1)]:
        allowed = np.unpackbits(masks[engine._filled[slot]].view(np.uint8), bitorder="little")[:n_vocab].astype(bool)
        assert np.array_equal(logits[row][allowed], before[row][allowed])
        assert np.all(np.isneginf(logits[row][~allowed]))
    assert np.array_equal(logits[[2, 4]], before[[2, 4]])
    assert (engine.counts.applies, engine.counts.rows_masked) == (1, 3) and engine.counts.apply_s > 0


def test_dense_rows_are_those_allowing_most_of_the_vocabulary():
    """/status's dense_rows: a row allowing tokens across most mask words counts, a row of a few
    allowed tokens (a JSON structure's next key) or none does not."""
    import numpy as np

    from pflash_plugin.engine.constraint_masks import _dense

    masks = np.zeros((5, 4000), dtype=np.int32)
    masks[1] = -1  # everything (a string's characters)
    masks[2, :100] = 1  # a few tokens
    masks[3, :1000] = 7  # a quarter of the vocabulary
    masks[4:, :3000] = -1  # three quarters
    assert _dense(masks) == 2


def test_masks_filled_beside_the_decode_give_the_serial_tokens(tiny_model, monkeypatch):
    """Where the runner overlaps (a GPU), the masks are filled while the decode runs (`launch`),
    not before sampling: the same tokens as the serial order, and filled in launch indeed."""
    from pflash_plugin.engine.sampling import Sampling

    filled_beside = []
    beside = Sampling.beside_decode

    def spy(self, rows):
        filled_beside.append(len(rows))
        beside(self, rows)

    monkeypatch.setattr(Sampling, "beside_decode", spy)

    def run_once(overlaps: bool) -> tuple[list[list[int]], ConstraintCounts]:
        model, engine = load_engine(tiny_model, EngineConfig(n_slots=3, max_ctx=256, n_threads=1, n_threads_batch=1))
        engine.runner.overlaps = overlaps
        try:
            requests = mixed(model, constrained=True)[:3]
            run(engine, requests)
            return [r.output_tokens for r in requests], engine.runner.sampling.constraints.counts
        finally:
            engine.stop()

    serial, counts = run_once(False)
    assert not filled_beside
    assert counts.fills_due > 0 and counts.fill_due_s > 0 and counts.fills_ahead == 0  # /status's split
    overlapped, counts = run_once(True)
    assert overlapped == serial and filled_beside
    assert counts.fills_ahead > 0 and counts.fill_ahead_s > 0 and counts.fills_due == 0


def test_a_fill_beside_the_decode_has_begun_when_the_engine_thread_goes_on(tiny_model):
    """`fill_ahead` returns once the fill thread has begun its fill: Python that the engine thread
    runs right after (the last step's text and events) does not hold the fill's start until the
    interpreter's switch interval makes it let go of the GIL (5 ms by default, 200 ms here)."""
    from pflash_plugin.engine.constraint_masks import ConstraintMasks
    from pflash_plugin.engine.constraints import check_constraint

    model, engine = load_engine(tiny_model, EngineConfig(n_slots=1, max_ctx=256, n_threads=1, n_threads_batch=1))
    engine.stop()
    grammar = compile_schema(PERSON)
    check_constraint(model, grammar)
    counts = ConstraintCounts()
    masks = ConstraintMasks(model.n_vocab, {0: PREBUILT.take(model, grammar)}, counts)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.2)
    try:
        masks.fill([0])  # the fill thread started (a thread's start hands it the GIL)
        masks.fill_ahead([0])
        busy = time.perf_counter() + 0.1
        while time.perf_counter() < busy:  # the engine thread's Python: it holds the GIL throughout
            pass
        first = counts.fill_start_s
        masks.fill_due([0])
    finally:
        sys.setswitchinterval(interval)
        masks.close()
    assert counts.fills_ahead == 1 and counts.rows_filled == 2
    assert counts.fill_start_s - first < 0.05, counts  # without the wait for its start: ~0.1 s (the busy loop)


def test_rows_that_their_mask_forces_skip_mask_and_sampler_for_the_same_tokens(tiny_model, monkeypatch):
    """A constrained row whose mask allows one token alone (a JSON key, a bracket) takes it without
    its logits masked or sampled: every filled row is masked or forced, and the tokens (greedy,
    seeded at 0.9 with a penalty) are those of the masked path."""
    from pflash_plugin.engine.constraint_masks import ConstraintMasks

    def run_once() -> tuple[list[list[int]], ConstraintCounts]:
        model, engine = load_engine(tiny_model, EngineConfig(n_slots=3, max_ctx=256, n_threads=1, n_threads_batch=1))
        try:
            requests = mixed(model, constrained=True)[:2]
            requests.append(Request(model.tokenize("Person:"), SamplingParams(
                max_tokens=48, temperature=0.9, seed=3, repeat_penalty=1.3, constraint=compile_schema(PERSON))))
            run(engine, requests)
            return [r.output_tokens for r in requests], engine.runner.sampling.constraints.counts
        finally:
            engine.stop()

    forced, counts = run_once()
    assert counts.rows_forced > 0 and counts.rows_masked + counts.rows_forced == counts.rows_filled
    monkeypatch.setattr(ConstraintMasks, "forced", lambda self, slot: None)
    masked, counts = run_once()
    assert counts.rows_masked == counts.rows_filled and forced == masked


def test_a_fill_beside_the_decode_runs_while_the_engine_thread_releases_the_last_steps_text(tiny_model, monkeypatch):
    """Beside the decode the masks fill on their own thread, and the engine thread goes on meanwhile
    to the last step's text and events (Stepping.release_last; on an H200 the fill was 6 ms of the
    engine thread a step before it): each such fill sees that release begin before it ends. The
    tokens are the serial order's."""
    from pflash_plugin.engine.constraint_masks import ConstraintMasks
    from pflash_plugin.engine.stepping import Stepping

    released, overlapped, engine_thread = threading.Event(), [], []
    fill, release = ConstraintMasks._fill_thread, Stepping.release_last

    def waiting_fill(self, jobs, masks, handed):  # its end waits for the release to begin
        filled = fill(self, jobs, masks, handed)
        elsewhere = threading.current_thread() not in engine_thread
        overlapped.append(elsewhere and released.wait(2 if all(overlapped) else 0))
        released.clear()
        return filled

    def spy(self, fresh_only=False):  # a first token's release at its collect is not the one beside the decode
        if not fresh_only:
            engine_thread[:] = [threading.current_thread()]
            released.set()
        release(self, fresh_only)

    def run_once(overlaps: bool) -> list[list[int]]:
        model, engine = load_engine(tiny_model, EngineConfig(n_slots=3, max_ctx=256, n_threads=1, n_threads_batch=1))
        engine.runner.overlaps = overlaps
        try:
            requests = mixed(model, constrained=True)[:3]
            run(engine, requests)
            return [r.output_tokens for r in requests]
        finally:
            engine.stop()

    serial = run_once(False)
    monkeypatch.setattr(ConstraintMasks, "_fill_thread", waiting_fill)
    monkeypatch.setattr(Stepping, "release_last", spy)
    assert run_once(True) == serial
    assert len(overlapped) > 10 and all(overlapped)


def test_string_slices_fit_the_vocabulary():
    """llguidance's slices with a bound at each string length that many tokens have (here 2,000
    of 2,013 tokens spell 12 characters), llguidance's own where none is crowded."""
    import llguidance

    from pflash_plugin.llama.guidance import string_slices

    general = llguidance.LLTokenizer.general_slices()
    assert string_slices([b"a", b"bc", b'"quoted"', *[b"\xff"] * 640]) == general  # no length has 1/64 of them
    pieces = [b"<extra_%d>" % i for i in range(1000, 3000)] + [b"x" * n for n in range(1, 14)]
    fitted = string_slices(pieces)
    assert fitted == [*general[:2], general[1].replace("10", "12"), *general[2:]]


def test_the_tokenizer_fitted_slices_give_the_general_slices_masks(monkeypatch):
    """The model's llguidance tokenizer is built with slices fitted to its vocabulary (at a 128K
    vocabulary of 11-14-character tokens, a bounded string's masks 2-15x faster), and the masks
    through seeded answers of a bounded-string schema are those of llguidance's own slices."""
    import llguidance
    import numpy as np

    from pflash_plugin.engine.constraint_masks import _allowed_ids
    from pflash_plugin.engine.constraints import LIMITS
    from pflash_plugin.llama import Model
    from pflash_plugin.llama.guidance import _VocabTokenizer, guidance_tokenizer, string_slices
    from pflash_plugin.testing import cached_tiny_llama

    model = Model(cached_tiny_llama(vocab_extra=20000))
    built = []
    real = llguidance.LLTokenizer
    monkeypatch.setattr(llguidance, "LLTokenizer",
                        lambda *args, **kwargs: built.append(kwargs) or real(*args, **kwargs))
    fitted = guidance_tokenizer(model)
    assert built and built[0]["slices"] == string_slices(_VocabTokenizer(model).pieces) != real.general_slices()
    general = fitted.with_slices(real.general_slices())
    grammar = compile_schema({"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                               "note": {"type": "string", "maxLength": 15}},
                              "required": ["name", "note"]})
    words = (model.n_vocab + 31) // 32
    for seed in range(3):
        rng = np.random.default_rng(seed)
        pair = [llguidance.LLMatcher(t, grammar, log_level=0, limits=LIMITS) for t in (fitted, general)]
        masks = np.zeros((2, words), dtype=np.int32)
        while not pair[0].is_stopped():
            for matcher, mask in zip(pair, masks):
                matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
            assert np.array_equal(masks[0], masks[1])
            token = int(rng.choice(_allowed_ids(masks[0], model.n_vocab)))
            assert all(matcher.consume_token(token) for matcher in pair)


def test_a_schema_row_keeps_stop_strings_logprobs_and_min_tokens(server):
    """A constrained row's other fields as on any row: its stop string ends it, its log-probabilities
    come from the row before the mask (the top alternatives need not be allowed ones), and
    min_tokens cannot hold back the end once the JSON is closed."""
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    stopped = httpx.post(server.url + "/v1/completions", json={
        "prompt": "Person:", "max_tokens": 60, "temperature": 0, "response_format": schema, "stop": ['"age"'],
        "logprobs": 3}, timeout=60).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"].startswith('{') and "age" not in choice["text"]
    tops = choice["logprobs"]["top_logprobs"]
    assert tops and all(len(top) == 3 for top in tops)
    first = tops[0]  # the text must open with "{": the row before the mask ranks other tokens too
    assert all(value > -1e9 for value in first.values()) and any(t.strip() not in ("{", "") for t in first), first
    closed = httpx.post(server.url + "/v1/completions", json={
        "prompt": "Person:", "max_tokens": 80, "min_tokens": 80, "temperature": 0, "response_format": schema},
        timeout=60).json()["choices"][0]
    assert closed["finish_reason"] == "stop" and set(json.loads(closed["text"])) == {"name", "age", "ok"}


def test_a_matcher_over_llguidance_limits_ends_only_its_request(tiny_model, monkeypatch):
    """llguidance's bounds are counts: past one (here Earley items in a row, lowered to 3) the
    matcher errs and its request ends INVALID with the reason; the request beside it goes on."""
    import llguidance

    from pflash_plugin.engine import constraints
    from pflash_plugin.engine.request import ErrorKind

    monkeypatch.setattr(constraints, "LIMITS", llguidance.LLParserLimits(max_items_in_row=3, verbose_errors=False))
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=2, max_ctx=256, n_threads=1, n_threads_batch=1))
    try:
        a = model.tokenize("a", add_special=False)[-1]
        guided = Request(model.tokenize("hi"), SamplingParams(max_tokens=20, temperature=0, logit_bias={a: 100.0},
                                                               constraint=compile_gbnf(AMBIGUOUS)))
        beside = Request(model.tokenize("hello"), SamplingParams(max_tokens=12, temperature=0))
        ends = run(engine, [guided, beside])
    finally:
        engine.stop()
    error = ends[guided.request_id]
    assert isinstance(error, ErrorEvent) and error.kind is ErrorKind.INVALID
    assert "the grammar cannot go on" in error.message and "max is 3" in error.message
    assert "<" not in error.message  # no markup of llguidance's
    assert isinstance(ends[beside.request_id], FinishEvent) and len(beside.output_tokens) == 12


def test_a_schema_object_is_closed_unless_it_says_otherwise(tiny_model):
    """As llama_cpp's converter (and llama-server) read a schema: an object that lists properties
    takes no others unless `additionalProperties` says so; whitespace is a space at most."""
    import llguidance

    from pflash_plugin.engine.constraints import LIMITS
    from pflash_plugin.llama import Model
    from pflash_plugin.llama.guidance import guidance_tokenizer

    model = Model(str(tiny_model))
    tokenizer = guidance_tokenizer(model)

    def takes(schema: dict, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, compile_schema(schema), log_level=0, limits=LIMITS)
        return matcher.consume_tokens(model.tokenize(text, add_special=False)) and not matcher.is_error()

    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert takes(listed, '{"a": 1}') and not takes(listed, '{"a": 1, "b": 2}')
    assert not takes(listed, '{"a":\n\n1}')
    assert takes({**listed, "additionalProperties": True}, '{"a": 1, "b": 2}')
    nested = {"type": "object", "properties": {"p": listed}}
    assert takes(nested, '{"p": {"a": 1}}') and not takes(nested, '{"p": {"a": 1, "c": 3}}')
