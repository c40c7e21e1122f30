"""The wire: each API's request and response models, their errors (RequestError and the error
shapes of OpenAI and Anthropic), usage counts. The bottom of the server: it imports no other part."""
