"""Speculative decoding inside continuous batching (issue 47): proposers draft, the engine verifies."""

from pflash_plugin.engine.speculation.proposer import DraftRow, Proposer

__all__ = ["DraftRow", "Proposer"]
