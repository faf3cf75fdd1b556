"""decompax.measures: measurements of a decomposition.

Pure functions that say what components do, for the in-loop evaluation and
for finished runs alike: the toy recovery metrics on feature probes
(`probe`), counts of CI over a batch (`ci_counts`), a harvest's per-batch
component statistics (`component_stats`), and the part-of-speech
measurement of units (`unit_activity`, `tag_profile`, `tag_metrics`,
`tag_context`; `docs/tag_profiles.md`). No model code, no I/O, no loss.
Imports `core`.
"""
