"""Test helpers (tiny synthetic GGUF models, written by pflash_plugin.llama.tiny_gguf) so tests need
no downloaded weights."""

from pflash_plugin.llama.tiny_gguf import (
    CHATML_TEMPLATE,
    cached_tiny_llama,
    tiny_model_path,
    tiny_vocab,
    write_tiny_llama,
)
from pflash_plugin.llama.tiny_projector import cached_tiny_projector

__all__ = [
    "CHATML_TEMPLATE",
    "cached_tiny_llama",
    "cached_tiny_projector",
    "tiny_model_path",
    "tiny_vocab",
    "write_tiny_llama",
]
