"""The OpenAI-compatible surface: request bodies and their checks, responses, streaming, tool calls, text codec."""
