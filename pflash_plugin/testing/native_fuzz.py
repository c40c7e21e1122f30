"""Hostile sampling and grammar parameters against a real server in a child process.

A C++ exception or an assertion inside llama.cpp aborts the whole process, so the server runs as
a child: a request that kills it is a finding with the child's exit status and the tail of its
log, and the run never takes the caller down. Every answer must be below 500, with no server
error inside a stream, and the server must still be healthy at the end. Cases are generated from
one seed (the same seed sends the same cases), after SEED_CASES, the requests that once aborted.
"""
from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .fuzz import server_error_event

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def seed_cases(eog_tokens: list[int]) -> list[tuple[str, dict]]:
    """The requests that aborted the server (issue 13): a grammar that allows only end-of-generation
    while min_tokens, or a -inf logit bias, takes that away; a JSON schema ending with min_tokens."""
    only_a = 'root ::= "a"'
    return [
        (COMPLETIONS, {"prompt": "Hello", "max_tokens": 8, "min_tokens": 5, "grammar": only_a}),
        (COMPLETIONS, {"prompt": "Hello", "max_tokens": 8, "grammar": only_a,
                       "logit_bias": {str(t): float("-inf") for t in eog_tokens}}),
        (COMPLETIONS, {"prompt": "Hello", "max_tokens": 8, "grammar": only_a,
                       "logit_bias": {str(t): -100.0 for t in eog_tokens}}),
        (CHAT, {"messages": [{"role": "user", "content": "Hello"}], "min_tokens": 300,
                "response_format": {"type": "json_object", "schema": {"type": "boolean"}}}),
    ]


def nested_optionals(depth: int) -> str:
    """Issue 22's grammar: each level doubles llama.cpp's parse stacks, and every character re-expands
    them (depth 8 is 2.4 s a token on the tiny model, depth 17 stalled the demo model for minutes)."""
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}? r{i + 1}?\n" for i in range(depth)) + f'r{depth} ::= "a"'


def alternation(n: int) -> str:
    """A flat alternation of `n` literals: llama.cpp keeps a parse stack for each."""
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n))


GRAMMARS = [
    'root ::= "a"', 'root ::= ""', 'root ::= "a"*', 'root ::= [0-9]+ "."', 'root ::= ("yes" | "no") " " [a-z]{1,4}',
    'root ::= [^\\x00-\\U0010FFFF]', 'root ::= "\\x00"',  # no character; NUL, which no token may hold
    "root ::= <[999999]>",  # a token outside the vocabulary: nothing is allowed
    'root ::= "é" | "\\u00ff"', 'root ::= ("a" ("b" ("c")?)?)*', 'root ::= x{0,50}\nx ::= "x"',
    "root ::= (", "root ::= undefined", "start ::= \"a\"", "root ::= " + "(" * 300 + '"a"' + ")" * 300,
    "root ::= " + " ".join('"a"{0,2000}' for _ in range(12)),
    # what would stall every token step (issue 22): nested optionals, a flat alternation
    nested_optionals(8),
    alternation(3000),
]
SCHEMAS = [
    {"type": "boolean"}, {"type": "integer"}, {"enum": ["x", "y"]}, {"type": "string", "maxLength": 3},
    {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "null"}, "minItems": 2, "maxItems": 2}, {"type": "nonsense"},
    {"enum": [f"v{i}" for i in range(3000)]},
]
FLOATS = [0.0, 1e-30, 1e-8, 0.5, 1.0, 2.0, 100.0, 1e30, float("nan"), float("inf"), -1.0]


def _pick(rng: random.Random, values: list[Any], p: float = 0.5) -> Any:
    """One of `values`, or nothing (the field left out) with probability 1 - p."""
    return rng.choice(values) if rng.random() < p else None


def _sampling(rng: random.Random, n_vocab: int, eog_tokens: list[int]) -> dict:
    tokens = eog_tokens + [rng.randrange(n_vocab) for _ in range(3)]
    fields = {
        "max_tokens": rng.choice([1, 2, 5, 12]),
        "min_tokens": _pick(rng, [0, 1, 5, 20, 300]),
        "temperature": _pick(rng, FLOATS),
        "top_k": _pick(rng, [0, 1, 2, 40, 10**6, 2**40]),
        "top_p": _pick(rng, [0.0, 1e-9, 0.5, 1.0]),
        "min_p": _pick(rng, [0.0, 1e-9, 0.5, 1.0]),
        "typical_p": _pick(rng, [1e-9, 0.5, 1.0]),
        "repeat_penalty": _pick(rng, [0.0, 1e-30, 1.0, 1.5, 1e30, float("inf")]),
        "presence_penalty": _pick(rng, [-2.0, 0.0, 2.0]),
        "frequency_penalty": _pick(rng, [-2.0, 0.0, 2.0]),
        "mirostat_mode": _pick(rng, [0, 1, 2], 0.3),
        "mirostat_tau": _pick(rng, [0.0, 5.0, 10.0], 0.3),
        "mirostat_eta": _pick(rng, [0.001, 1.0], 0.3),
        "seed": _pick(rng, [0, 1, -1, 2**40]),
        "stop": _pick(rng, ["a", ["\n", "x"], "", ["é"]], 0.3),
        "logit_bias": _pick(rng, [{str(t): rng.choice([-100.0, -1e999, 0.0, 100.0, 5.0]) for t in
                                   rng.sample(tokens, rng.randint(1, len(tokens)))}]),
        "n": _pick(rng, [1, 2, 3], 0.2),
        "stream": _pick(rng, [True, False], 0.3),
    }
    return {k: v for k, v in fields.items() if v is not None}


def generated_case(rng: random.Random, n_vocab: int, eog_tokens: list[int]) -> tuple[str, dict]:
    """One request: sampling parameters, often a grammar or (chat) a JSON schema."""
    body = _sampling(rng, n_vocab, eog_tokens)
    if rng.random() < 0.5:
        body["prompt"] = rng.choice(["Hello", "", ["a b", "c"], [1, 5, 9], "the sea is"])
        if rng.random() < 0.7:
            body["grammar"] = rng.choice(GRAMMARS)
        if rng.random() < 0.3:
            body["logprobs"] = rng.choice([0, 3, 20])
        return COMPLETIONS, body
    body["messages"] = [{"role": "user", "content": rng.choice(["Hello", "", "Say yes"])}]
    roll = rng.random()
    if roll < 0.4:
        schema = rng.choice(SCHEMAS + [None])
        body["response_format"] = {"type": "json_object", **({"schema": schema} if schema else {})}
    elif roll < 0.7:
        body["grammar"] = rng.choice(GRAMMARS)
    return CHAT, body


def vocab_facts(model: Path) -> tuple[int, list[int]]:
    """(vocabulary size, end-of-generation tokens) of the model the server runs."""
    from ..llama import Model

    loaded = Model(model)
    try:
        return loaded.n_vocab, loaded.eog_tokens
    finally:
        loaded.close()


@dataclass
class Finding:
    path: str
    body: dict
    outcome: str  # the status and answer, or how the server died


@dataclass
class FuzzResult:
    statuses: Counter = field(default_factory=Counter)  # HTTP status -> cases (0: no answer)
    findings: list[Finding] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())


class ServerProcess:
    """`python -m pflash_plugin.server` on a free loopback port, its output in `log`."""

    def __init__(self, args: list[str], log: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("wb") as out:
            command = [sys.executable, "-m", "pflash_plugin.server", "--port", str(self.port), *args]
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"the server did not become healthy: {self.death()}")

    def death(self) -> str:
        """How the process ended (exit status, signal) and the end of its log; '' while alive."""
        code = self.proc.poll()
        if code is None:
            return ""
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"{how}; log tail:\n{self.log.read_text(errors='replace')[-3000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@contextmanager
def server_process(model: Path, log: Path, *extra: str) -> Iterator[ServerProcess]:
    """A healthy child server on the tiny model with one thread per step, stopped at the end."""
    server = ServerProcess(["--model", str(model), "--n_ctx", "512", "--max_concurrency", "2",
                            "--n_threads", "1", "--n_threads_batch", "1", *extra], log)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def send(server: ServerProcess, path: str, body: dict, timeout_s: float = 60.0) -> tuple[int, Finding | None]:
    """One request: its status (0: no answer), and a finding if it got a 5xx, a server error event,
    no answer, or killed the server. JSON as Python writes it: NaN and Infinity go through."""
    import httpx

    try:
        response = httpx.post(server.url + path, content=json.dumps(body), timeout=timeout_s,
                              headers={"content-type": "application/json"})
        status, outcome = response.status_code, f"{response.status_code}: {response.text[:500]}"
        bad = status >= 500 or server_error_event(response.text)
    except httpx.HTTPError as error:
        status, outcome, bad = 0, f"no answer: {error!r}", True
    if server.proc.poll() is not None:
        return status, Finding(path, body, server.death())
    return status, Finding(path, body, outcome) if bad else None


def run_fuzz(server: ServerProcess, cases: int, n_vocab: int, eog_tokens: list[int], seed: int = 0) -> FuzzResult:
    """The seed cases, then generated ones up to `cases` in all; stops at the first dead server."""
    rng = random.Random(seed)
    requests = seed_cases(eog_tokens)
    requests += [generated_case(rng, n_vocab, eog_tokens) for _ in range(max(cases - len(requests), 0))]
    result = FuzzResult()
    for path, body in requests:
        status, finding = send(server, path, body)
        result.statuses[status] += 1
        if finding is not None:
            result.findings.append(finding)
            if server.proc.poll() is not None:
                break
    return result
