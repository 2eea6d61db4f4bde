"""The OpenAI HTTP API on the front: chat completions, completions, models (SSE or not)."""
