"""decompax.placement: device meshes and the placement of state on them.

Mesh sizes, the per-category layouts and presets, sharding trees and the
step's `constrain` hook, moves between processes and the XLA option sets.
Never builds a mesh itself (`bin` does). Imports `core`.
"""
