"""decompax.analysis."""
