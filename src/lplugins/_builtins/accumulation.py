"""Built-in plugin `accumulation` (being written)."""
