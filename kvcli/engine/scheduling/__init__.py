"""The engine's scheduling job."""
