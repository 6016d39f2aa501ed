"""The engine's prompt job."""
