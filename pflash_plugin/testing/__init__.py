"""Test helpers (tiny synthetic GGUF models) so tests need no downloaded weights."""

from pflash_plugin.testing.tiny_gguf import (
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
