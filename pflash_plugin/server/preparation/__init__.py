"""Request preparation: a chat request made one engine request (prompt, sampling, grammars for tools
and JSON schemas), checked against the model's limits before it is queued."""
