"""decompax.recipe."""
