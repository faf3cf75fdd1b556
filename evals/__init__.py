"""decompax.evals: evaluation during training.

The jitted eval passes over held-out batches (`eval_step`: the fast and the
slow tier, SPEC §11), the mask variants' outputs and CE metrics they score
(`eval_metrics`), and a targeted run's task metrics (`task_eval`). What is
run when, and what is done with the results, is `recipe.evaluation`'s.
No I/O. Imports `core`, `losses` (the eval's adversary and hidden and
locality terms) and `measures`.
"""
