"""The OpenAI-compatible side: the chat-completions endpoint, its schema and routes, sessions, agents."""
