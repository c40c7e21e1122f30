"""The chat-format layer: how a model's conversation is rendered and how the text it writes is read back.

Between the server (the API surfaces) and the engine: one place per model family (reasoning markers,
tool-call syntaxes), chosen from the GGUF's chat template, with override flags. Its readers are
streaming (O(1) per token) and yield typed deltas (pflash_plugin.chat.deltas) that the server's
presenters turn into each API's shape.
"""
