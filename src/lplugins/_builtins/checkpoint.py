"""Built-in plugin `checkpoint` (being written)."""
