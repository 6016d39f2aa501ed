"""Servers: a warm process that keeps models and restored caches in memory (unix socket)."""
