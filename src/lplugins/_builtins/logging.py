"""Built-in plugin `logging` (being written)."""
