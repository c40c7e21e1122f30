"""The command line: stock's flags (made from the settings classes by llama_cpp's own
`add_args_from_model`, so they parse exactly as stock parses them), shown in groups, with our
defaults and our meanings: a stock key this server refuses, or that has no effect here, says so."""
from __future__ import annotations

import argparse
from typing import Any, cast

from llama_cpp.server.cli import add_args_from_model

from .llama_params import ALWAYS_SO, REFUSED
from .settings import ServerSettings, Settings

MODEL = "model"
SERVER = "server"
CONCURRENCY = "concurrency and KV"
PFLASH = "PFlash prefill compression"
STOCK = "other llama_cpp.server model keys"

GROUPS = {
    MODEL: "What to serve and how it loads (config file: under models:).",
    SERVER: "The HTTP server (config file: at the top level).",
    CONCURRENCY: "Slots, the shared KV pool, the queue and threads (config file: under models:).",
    PFLASH: "Prompts scored by a drafter and prefilled in part (docs/pflash.md; config file: under models:).",
    STOCK: "llama.cpp's context and RoPE settings, as stock takes them (config file: under models:).",
}
_MODEL_KEYS = {"model", "model_alias", "chat_format", "chat_template_kwargs", "n_gpu_layers", "split_mode", "main_gpu",
               "tensor_split", "lora_path", "embedding", "verbose", "seed", "use_mmap", "use_mlock",
               "kv_overrides", "rpc_servers", "numa", "type_k", "type_v", "offload_kqv", "mmproj", "clip_model_path",
               "media_hosts", "media_max_bytes", "media_max_items", "media_max_pixels", "media_fetch_timeout_s",
               "media_cache_mb", "media_encoders", "spm_infill"}
_CONCURRENCY_KEYS = {"max_concurrency", "max_queue", "kv_pool_tokens", "kv_layout", "max_ctx", "kv_page_size",
                     "prefill_chunk", "prefill_per_answer", "prefill_chunk_per_step", "schedule_policy", "max_step_s",
                     "n_ctx", "n_batch", "n_ubatch", "n_threads", "n_threads_batch", "flash_attn", "swa_full",
                     "cuda_graphs"}
NO_EFFECT = {
    "interrupt_requests": "requests run together in slots: none interrupts another",
    **ALWAYS_SO,
}


def group_of(key: str) -> str:
    if key in ServerSettings.model_fields:
        return SERVER
    if key.startswith("pflash") or key == "draft_residency":
        return PFLASH
    if key in _CONCURRENCY_KEYS:
        return CONCURRENCY
    return MODEL if key in _MODEL_KEYS else STOCK


# stock keys whose meaning differs here
OUR_MEANING = {
    "chat_format": "One of llama_cpp's chat formats, instead of the GGUF's chat template (default: the template). "
    "chatml-function-calling and functionary* are refused: tools work through the template (docs/tools.md). "
    "The vision handlers' names need --mmproj: mtmd and gemma4 render with the GGUF's template, llava-1-5, "
    "llava-1-6, obsidian, moondream, nanollava, llama-3-vision-alpha, minicpm-v-2.6 and qwen2.5-vl with stock's "
    "template of that handler (docs/vision.md).",
    "clip_model_path": "The same as --mmproj (stock's name): the model's multimodal projector GGUF.",
    "cache": "Keep the KV of prefixes evicted from the slots in host RAM and restore it for a prompt that "
    "extends one (the prefix cache in the KV pool is always on).",
    "cache_size": "Bytes of host RAM for --cache (saved sequence states, least recently used out first).",
    "n_batch": "Tokens of one decode step (decode rows first, prefill chunks in the rest). Default: 2048 where the "
    "model's layers run on a GPU (llama-server's), 512 on the CPU (stock's).",
}


def annotated(key: str, text: str | None) -> str | None:
    """A flag's help, marked where this server refuses the key or ignores its value."""
    if key in OUR_MEANING:
        return OUR_MEANING[key]
    if key in REFUSED:
        return f"REFUSED unless left at its default: {REFUSED[key]}."
    if key in NO_EFFECT:
        return f"Accepted, no effect: {NO_EFFECT[key]}."
    return text


class _Grouped:
    """Takes stock's add_argument calls and adds each flag to its group, with its help annotated."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.groups = {name: parser.add_argument_group(name, text) for name, text in GROUPS.items()}

    def add_argument(self, *flags: str, dest: str, help: str | None = None, **kw: Any) -> argparse.Action:
        return self.groups[group_of(dest)].add_argument(*flags, dest=dest, help=annotated(dest, help), **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pflash_plugin.server",
        usage="%(prog)s [--model PATH.gguf] [--FLAG VALUE ...] | --config_file FILE",
        description="pflash-plugin: llama-cpp-python's OpenAI-compatible server with concurrent slots and PFlash "
        "prefill compression. Every stock flag, environment variable and config-file key works.",
    )
    add_args_from_model(cast(argparse.ArgumentParser, _Grouped(parser)), Settings)
    parser.add_argument("--config_file", type=str, help="A YAML or JSON file of server keys and a list of models "
                        "(examples/config.yaml); server flags (--port, --api_key, ...) apply over it, model flags "
                        "beside it are refused (set them under models:).")
    return parser
