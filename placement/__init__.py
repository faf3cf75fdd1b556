"""decompax.placement."""
