"""decompax.io: run records, checkpoints and figures.

`load_decomposition(path)` is the one call consumers of a trained
decomposition need (see `decomposition`).
"""

from decompax.io.decomposition import load_decomposition  # noqa: F401
