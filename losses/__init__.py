"""decompax.losses."""
