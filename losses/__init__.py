"""decompax.losses: the objective's terms.

Pure loss functions (faithfulness, minimality, stochastic and adversarial
reconstruction, hidden-activation and locality terms) and the `LossTerm`
constructors the training step sums (`loss_terms`). What the objective does
not optimise, evaluation and measurement, lives in `evals` and `measures`.
No model code, no I/O. Imports `core`.
"""
