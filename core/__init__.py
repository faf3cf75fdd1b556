"""decompax.core: the engine, knowing no particular model.

Site specs and the stacked rank-1 factors, masks and their RNG, CI
functions and squashings, schedules and optimizers, the shared attention
primitives, the target function table (`TargetFns`), the training step and
its term hooks, and the finiteness record (`health`). Never names Llama,
Qwen or a toy. Imports no sibling package.
"""
