"""This machine's rates for the work a training step does, measured now.

A helper of `bench/profile.py` (no `main`). Each rate is the best of several
timings: on a shared machine, the run least slowed by other processes comes
closest to what the machine can do. Elementwise rates are timed as a jitted
loop run at two trip counts, so that dispatch cancels:
  * `fused_bytes_per_s`: bytes/s of the fused `x * b + c` at a given size;
  * `elementwise_ops_per_s`: operations/s (each multiply and add counted,
    as in the HLO) of independent multiply-adds in one fusion over an
    in-cache array, as the CI function's hidden units are;
  * `opcode_cost`: a costlier opcode's time per element, in those
    operations.
"""

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

Elementwise = Callable[..., jax.Array]

# A probe per costly opcode, applied to values in [0, 0.5) and keeping them
# there, with the plain operations it adds around the opcode.
_PROBES = {
  "erf": (lax.erf, 0),
  "divide": (lambda x: 0.5 / (x + 1.0), 1),
  "exponential": (lambda x: jnp.exp(-x) * 0.5, 2),
  "log": (lambda x: jnp.log(x + 1.0), 1),
  "tanh": (jnp.tanh, 0),
  "sqrt": (lambda x: jnp.sqrt(x) * 0.5, 1),
  "rsqrt": (lambda x: lax.rsqrt(x + 1.0) * 0.5, 2),
  "logistic": (lambda x: jax.nn.sigmoid(x) - 0.5, 1),
}
IN_CACHE = 1 << 16  # fp32 elements: 256 KiB, in any core's L2


def has_probe(opcode: str) -> bool:
  """Return whether `opcode_cost` measures `opcode` (else it costs 1)."""
  return opcode in _PROBES


def _best_seconds(f: Callable[[], object], repeats: int) -> float:
  f()  # compiles
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    f()
    times.append(time.perf_counter() - start)
  return min(times)


def _seconds_per_trip(body: Elementwise, x: jax.Array, *args: jax.Array,
                      trips: int, repeats: int = 7) -> float:
  """Return the time of one `x = body(x, *args)` run back to back in a
  jitted loop, from two trip counts so that dispatch cancels."""
  # A traced trip count keeps the loop rolled: unrolled, XLA would fuse the
  # trips into one pass.
  loop = jax.jit(lambda count, x, *args: lax.fori_loop(
    0, count, lambda _, x: body(x, *args), x))

  def seconds(count: int) -> float:
    return _best_seconds(
      lambda: loop(count, x, *args).block_until_ready(), repeats)

  return max(seconds(1 + trips) - seconds(1), 1e-12) / trips


def _uniform(n: int, count: int) -> list[jax.Array]:
  keys = jax.random.split(jax.random.key(0), count)
  return [0.5 * jax.random.uniform(k, (n,), jnp.float32) for k in keys]


def fused_bytes_per_s(n: int) -> float:
  """Return the bytes/s of the fused `x * b + c` over `n` fp32 elements
  (three read, one written)."""
  x, b, c = _uniform(n, 3)
  trips = min(4096, max(4, (1 << 31) // (16 * n)))  # about 2 GB streamed
  return 16 * n / _seconds_per_trip(lambda x, b, c: x * b + c, x, b, c,
                                    trips=trips)


def _sum_of_terms(x: jax.Array, f: Elementwise, width: int) -> jax.Array:
  """Return the mean of `f(x·a_k + b_k)` over `width` terms summed as a
  tree: independent terms like the hidden units of the CI function, so the
  rate measured is throughput, not one chain's latency."""
  terms = [f(x * (0.5 + k / 64) + k / 256) for k in range(width)]
  while len(terms) > 1:
    pairs = [a + b for a, b in zip(terms[::2], terms[1::2])]
    terms = pairs + terms[2 * len(pairs):]
  return terms[0] * (1 / width)


def _terms_seconds(f: Elementwise, width: int) -> float:
  (x,) = _uniform(IN_CACHE, 1)
  return _seconds_per_trip(lambda x: _sum_of_terms(x, f, width), x,
                           trips=64)


def elementwise_ops_per_s(width: int = 16) -> float:
  """Return the elementwise operations per second (each multiply and add
  counted, as in the HLO) of `width` independent multiply-adds per element,
  summed, in one fusion over an in-cache array."""
  ops = 3 * width  # a multiply and an add per term, the tree's adds, a scale
  return ops * IN_CACHE / _terms_seconds(lambda t: t, width)


def opcode_cost(opcode: str, ops_per_s: float, width: int = 16) -> float:
  """Return one `opcode` element's time in plain operations (1 unprobed):
  the time its probe adds to the independent multiply-adds above."""
  if opcode not in _PROBES:
    return 1.0
  probe, extra = _PROBES[opcode]
  seconds = _terms_seconds(probe, width)
  plain = 3 * width / ops_per_s * IN_CACHE
  return max(1.0, (seconds - plain) * ops_per_s / (width * IN_CACHE)
             - extra)
