"""decompax.io: the file system, and the only library package that writes it.

Run directories and their lock, the contract of every directory a binary
writes (`owned_dir`), metrics, saved arrays, checkpoints and resume,
decompositions, TensorBoard events, token and tag files, Hugging Face
checkpoints, a harvest's store, the transcoders' directory, and the report's
files (`report_files`: the PNGs and pages `render` builds). Writes are
atomic. Decides, trains and draws nothing. Imports `core` and `placement`.

`load_decomposition(path)` is the one call consumers of a trained
decomposition need (see `decomposition`).
"""

from decompax.io.decomposition import load_decomposition  # noqa: F401
