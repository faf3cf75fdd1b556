"""decompax.bin."""
