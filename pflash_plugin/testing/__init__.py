"""Test helpers (tiny synthetic GGUF models, written by pflash_plugin.llama.tiny_gguf) so tests need
no downloaded weights."""

from pflash_plugin.llama.tiny_gguf import (
    CHATML_TEMPLATE,
    cached_tiny_llama,
    tiny_model_path,
    tiny_vocab,
    write_tiny_llama,
)

__all__ = [
    "CHATML_TEMPLATE",
    "cached_tiny_llama",
    "tiny_model_path",
    "tiny_vocab",
    "write_tiny_llama",
]
