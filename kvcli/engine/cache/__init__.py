"""The engine's cache job."""
