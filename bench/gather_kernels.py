"""Two small computations whose TPU lowering set a step's or a harvest's
speed, each timed against its former form in one process: `./dev bench
gather_kernels`.

- **Vocabulary KL.** The fp32 `KL(softmax(clean) ‖ softmax(h·W))` with its
  gradient through the head matmul, at brown_m's head by default (8 × 512
  positions, d_model 512, vocabulary 8,192), with `jax.nn.log_softmax`
  against `core.stable_softmax.log_softmax`.
- **Token windows.** One site's top-context windows of a harvest batch
  (`measures.component_stats`), by element gathers (the former form), by
  slices (`sliced_windows`, the CPU's) and by rows selected
  (`selected_windows`, every other platform's), at brown_s's and
  brown_m's harvest shapes.

Each line gives the median ms a call and whether the result is bitwise
equal to the former form's (and its largest difference when not).
"""

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from decompax.core import stable_softmax
from decompax.measures import component_stats

_REPEATS = flags.DEFINE_integer("gather_repeats", 20, "Timed calls each.",
                                lower_bound=1)
_HEAD = flags.DEFINE_list("head_shape", ["8", "512", "512", "8192"],
                          "Batch, positions, d_model and vocabulary.")
_WINDOWS = flags.DEFINE_list(
  "window_shapes", ["8x64x256", "8x512x512"],
  "Harvest batches BxTxC whose windows to time (20 top positions, 8 "
  "tokens before and 4 after, as `bin/harvest`'s defaults).")


def element_windows(tokens, ci, flat_index, before, after):
  """The windows as `c·k·w` single elements gathered (the former form)."""
  t = tokens.shape[1]
  row, column = flat_index // t, flat_index % t
  at = column[..., None] + jnp.arange(-before, after + 1)
  inside = (at >= 0) & (at < t)
  at = jnp.clip(at, 0, t - 1)
  rows = jnp.broadcast_to(row[..., None], at.shape)
  component = jnp.arange(ci.shape[-1])[:, None, None]
  return (jnp.where(inside, tokens[rows, at], component_stats.NO_TOKEN),
          jnp.where(inside, ci[rows, at, component], 0.0))


def head_kl(log_softmax):
  """Return the mean KL of clean logits to `h·W`'s, by `log_softmax`."""
  def kl(h, w, clean):
    log_p = log_softmax(clean)
    log_q = log_softmax(h @ w)
    return jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1))
  return kl


def timed(fn, args, repeats: int) -> tuple[float, object]:
  """Return the median ms of `fn(*args)` after a first call, and its
  result."""
  out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times), out


def compared(name: str, ms: float, out, reference) -> str:
  leaves, reference = jax.tree.leaves(out), jax.tree.leaves(reference)
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(leaves, reference))
  gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves, reference))
  return f"  {name:34s} {ms:9.3f} ms  " + (
    "bitwise equal" if same else f"largest difference {gap:.3g}")


def head_lines(b: int, t: int, d: int, v: int, repeats: int = 3
               ) -> list[str]:
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  h = jax.random.normal(keys[0], (b, t, d))
  w = jax.random.normal(keys[1], (d, v)) * d ** -0.5
  clean = jax.random.normal(keys[2], (b, t, v))
  lines, reference = [f"vocabulary KL and its gradient, {b}x{t} positions, "
                      f"d_model {d}, vocabulary {v}"], None
  for name, fn in (("jax.nn.log_softmax (former)", jax.nn.log_softmax),
                   ("stable_softmax.log_softmax", stable_softmax.log_softmax)):
    step = jax.jit(jax.value_and_grad(head_kl(fn), argnums=(0, 1)))
    ms, out = timed(step, (h, w, clean), repeats)
    reference = out if reference is None else reference
    lines.append(compared(name, ms, out, reference))
  return lines


def window_lines(b: int, t: int, c: int, k: int = 20, before: int = 8,
                 after: int = 4, repeats: int = 3) -> list[str]:
  tokens = jax.random.randint(jax.random.PRNGKey(0), (b, t), 0, 8192)
  ci = jax.random.uniform(jax.random.PRNGKey(1), (b, t, c))
  _, flat_index = jax.lax.top_k(
    jnp.moveaxis(ci, -1, 0).reshape(c, b * t), min(k, b * t))
  lines, reference = [f"token windows of one site, {b}x{t} tokens, C={c}"], None
  for name, fn in (("element gathers (former)", element_windows),
                   ("slices (sliced_windows)", component_stats.sliced_windows),
                   ("rows selected (selected_windows)",
                    component_stats.selected_windows)):
    ms, out = timed(jax.jit(fn, static_argnums=(3, 4)),
                    (tokens, ci, flat_index, before, after), repeats)
    reference = out if reference is None else reference
    lines.append(compared(name, ms, out, reference))
  return lines


def main(argv):
  del argv
  print(f"{jax.devices()[0].platform}, JAX {jax.__version__}, float32")
  for line in head_lines(*map(int, _HEAD.value), repeats=_REPEATS.value):
    print(line, flush=True)
  for shape in _WINDOWS.value:
    for line in window_lines(*map(int, shape.split("x")),
                             repeats=_REPEATS.value):
      print(line, flush=True)


if __name__ == "__main__":
  app.run(main)
