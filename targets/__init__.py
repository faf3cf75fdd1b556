"""decompax.targets."""
