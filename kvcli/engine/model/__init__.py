"""The engine's model job."""
