"""decompax.io."""
