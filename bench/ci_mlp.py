"""Median jitted time of the component-MLP CI function, reference vs fast.

Run: `./dev bench ci_mlp`.
For each `(B, C, d_gate)` it times, in this one process, the forward alone
and `value_and_grad` with respect to the parameters and the input `h` (the
training step's use: `h = x @ V`), for `component_mlp.reference_pre` and
the layouts of `component_mlp.component_mlp_pre` (`cpu_pre` and
`accelerator_pre`, each forced whatever the backend, and on a TPU the
Pallas kernel `component_mlp_pallas.pallas_pre`), and reports
`[B, C, d_gate]` elements per second and each layout's speed-up over the
reference. The loss is `Σ clip(pre, 0, 1)²`, the shape of the importance
losses. Timings interleave the implementations so machine load hits all
alike. On an accelerator, `--shapes=2048x500x128` is ResidMLP-3's CI.
"""

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from decompax.core import ci_fns, component_mlp, component_mlp_pallas

_REPEATS = flags.DEFINE_integer("kernel_repeats", 30,
                                "Timed calls per function.")
_SHAPES = flags.DEFINE_list(
  "shapes", ["4096x20x16", "4096x200x16", "2048x100x16"],
  "Shapes BxCxD_GATE to time.")
_LAYOUTS = flags.DEFINE_list(
  "layouts", ["cpu", "accelerator", "pallas"],
  "Layouts to time beside the reference (pallas, and pallas_compact with "
  "its parameter rows not replicated, only on a TPU).")
_BLOCK_ROWS = flags.DEFINE_list(
  "pallas_block_rows", [str(component_mlp_pallas.BLOCK_ROWS)],
  "Positions per block of the Pallas kernels, each timed as a layout of "
  "its own (`pallas@<rows>`) beside the kernel's default.")


def make_inputs(b: int, c: int, d_gate: int):
  """Return trained-looking params (nonzero biases) and a `[b, c]` input."""
  keys = jax.random.split(jax.random.key(0), 4)
  params = ci_fns.init_component_mlp(keys[0], c, d_gate)
  params = params._replace(
    b_in=0.3 * jax.random.normal(keys[1], (c, d_gate)),
    b_out=0.1 * jax.random.normal(keys[2], (c,)))
  return params, jax.random.normal(keys[3], (b, c))


def loss_fn(pre_fn):
  """Return `(params, h) -> Σ clip(pre, 0, 1)²` for one implementation."""
  def loss(params, h):
    return jnp.sum(jnp.square(jnp.clip(pre_fn(params, h), 0.0, 1.0)))
  return loss


def median_times(fns: dict, args: tuple, repeats: int) -> dict:
  """Return each function's median wall time (s), calls interleaved."""
  for f in fns.values():
    jax.block_until_ready(f(*args))
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, f in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(f(*args))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def block_rows(values: list[str]) -> list[int]:
  """Return `--pallas_block_rows` as integers; ValueError naming a value
  that is not a positive multiple of 8 (a TPU tile's sublanes)."""
  out = []
  for value in values:
    if not value.isdigit() or int(value) < 8 or int(value) % 8:
      raise ValueError(f"--pallas_block_rows {value!r}: want a positive "
                       "multiple of 8")
    out.append(int(value))
  return out


def pallas_layouts(rows: list[int]) -> dict:
  """Return the Pallas kernels to time: replicated and compact parameter
  rows at the default block, and each other block size as `@<rows>`."""
  default = component_mlp_pallas.BLOCK_ROWS
  out = {}
  for replicated, name in ((True, "pallas"), (False, "pallas_compact")):
    for r in sorted({default, *rows}):
      out[name if r == default else f"{name}@{r}"] = functools.partial(
        component_mlp_pallas.pallas_pre, replicated=replicated,
        block_rows=r)
  return out


def main(argv):
  del argv
  layouts = {"cpu": component_mlp.cpu_pre,
             "accelerator": component_mlp.accelerator_pre}
  known = {"cpu", "accelerator", "pallas", "pallas_compact"}
  unknown = set(_LAYOUTS.value) - known
  if unknown:
    sys.exit(f"ci_mlp: error: unknown --layouts {', '.join(sorted(unknown))}"
             f"; use {', '.join(sorted(known))}")
  try:
    rows = block_rows(_BLOCK_ROWS.value)
  except ValueError as e:
    sys.exit(f"ci_mlp: error: {e}")
  if jax.default_backend() == "tpu":
    layouts.update(pallas_layouts(rows))
  wanted = set(_LAYOUTS.value)
  impls = {"reference": component_mlp.reference_pre,
           **{k: v for k, v in layouts.items()
              if k.partition("@")[0] in wanted}}
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
  print(f"{'B':>5} {'C':>4} {'G':>3} {'impl':<20} {'fwd ms':>8} "
        f"{'Gelem/s':>8} {'fwd+bwd ms':>11} {'Gelem/s':>8}")
  for shape in _SHAPES.value:
    b, c, d_gate = (int(v) for v in shape.split("x"))
    params, h = make_inputs(b, c, d_gate)
    fns = {}
    for name, pre_fn in impls.items():
      loss = loss_fn(pre_fn)
      fns[name, "fwd"] = jax.jit(loss)
      fns[name, "bwd"] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    ref = fns["reference", "bwd"](params, h)
    layouts = list(impls)[1:]
    err = {}
    for name in layouts:
      new = fns[name, "bwd"](params, h)
      err[name] = max(float(np.max(np.abs(x - y)) / np.max(np.abs(y)))
                      for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(ref)))
    med = median_times(fns, (params, h), _REPEATS.value)
    elements = b * c * d_gate
    for name in impls:
      fwd, bwd = med[name, "fwd"], med[name, "bwd"]
      print(f"{b:5d} {c:4d} {d_gate:3d} {name:<20} {1e3 * fwd:8.2f} "
            f"{elements / fwd / 1e9:8.3f} {1e3 * bwd:11.2f} "
            f"{elements / bwd / 1e9:8.3f}")
    for name in layouts:
      fwd = med["reference", "fwd"] / med[name, "fwd"]
      bwd = med["reference", "bwd"] / med[name, "bwd"]
      print(f"{'':14}{name}: speedup fwd {fwd:.1f}x, fwd+bwd {bwd:.1f}x; "
            f"max rel diff of value and grads {err[name]:.1e}", flush=True)


if __name__ == "__main__":
  sys.argv[0] = "ci_mlp"
  app.run(main)
