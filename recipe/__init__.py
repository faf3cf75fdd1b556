"""decompax.recipe: a run's settings and its assembly, nothing else.

The settings (`config`, each declared once with its domain), the rules that
join them (`checks`), flagfiles (`flagfiles`), the term registry, the
engine's objects from a config, checkpoint LMs and token files, a targeted
run's streams, the in-loop evaluator (`evaluation`) and `assembly`, which
builds a run once. Imports every library package but `analysis`.
"""
