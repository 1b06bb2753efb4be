"""The OpenAI surface: request/response structs, the chat handler, SSE."""
