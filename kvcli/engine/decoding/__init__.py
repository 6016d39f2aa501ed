"""The engine's decoding job."""
