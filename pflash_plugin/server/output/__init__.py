"""The output side: an engine request's events dispatched to the client, shown by a presenter in its
API's shape (OpenAI chunks, Responses events, Messages blocks), plain or streamed."""
