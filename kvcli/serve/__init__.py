"""Servers: a warm process that keeps models and restored caches in memory (unix socket), and the
OpenAI-compatible HTTP endpoint over the same open Sessions (http.py)."""
