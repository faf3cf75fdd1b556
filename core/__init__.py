"""decompax.core."""
