"""The API surfaces: the routes of OpenAI's chat/completions and embeddings, the Responses API,
Anthropic's Messages and the extras, each turning its wire body into a chat request and answering it."""
