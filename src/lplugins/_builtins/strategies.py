"""Built-in plugin `strategies` (being written)."""
