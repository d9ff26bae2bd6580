"""Built-in plugins. Each module is registered by name through the same hooks third parties use."""
