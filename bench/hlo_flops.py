"""Matmul FLOPs and loops of a compiled program, read from its optimized
HLO text (`compiled.as_text()`), and a matmul rate to hold them against.

`compiled_matmul_flops` counts contractions only, 2 FLOPs per
multiply-add: `dot`s, wherever fusion put them; `convolution`s, which is
what a TPU's compiler turns dots into (2 × output elements × the kernel's
input features × its window, the contraction each output element sums
over, whatever the feature and batch group counts); and the GPU library
calls that stand for them (cuBLAS GEMMs sized by their dimension numbers,
cuDNN flash attention by its score matrix). It multiplies every loop body by its
known trip count and takes a conditional's costliest branch. XLA's own
`cost_analysis()` (`xla_cost_flops`) counts each loop body once, so it
undercounts a step that scans layers by about their number; it also counts
elementwise work, which this count leaves out.
"""

import math
import re
import statistics
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"[a-z][a-z0-9]*\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(?:calls|to_apply|body)=%?([\w.\-]+)")
_BRANCHES = re.compile(
  r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?"
  r"([\w.\-]+))")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_REMAT = re.compile(r"\.remat\d*(\.|$)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# Custom calls that move, select or assume data, holding no matmul: a
# TPU's, and a CPU's top-k (a mixture of experts' routing).
_DATA_TARGETS = {"AllocateBuffer", "ConcatBitcast",
                 "AssumeGatherIndicesInBound", "TopK"}
# cuDNN flash attention: 2 score-sized matmuls forward; backward the 4
# gradient matmuls and the scores it recomputes.
_FMHA_MATMULS = {False: 2, True: 5}


class HloMatmuls(NamedTuple):
  """A compiled program's matmul FLOPs; `uncounted` names, with their
  counts, the instructions that may hold matmuls the count could not size
  (unknown custom calls, loops of unknown trip count); `rematerialized`
  is the part of `flops` in instructions XLA's own rematerialization pass
  cloned (named `<original>.remat`, `.remat2`, ...) to fit the program in
  the device's memory, which a TPU's compiler runs and the program as
  written does not ask for."""

  flops: float
  uncounted: dict[str, int]
  rematerialized: float = 0.0


class _Instruction(NamedTuple):
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  arguments: str  # the text between the opcode's parentheses


def _dims(shape: str) -> list[int]:
  """Return the dimensions of an array shape (a tuple's first array)."""
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _balanced(text: str) -> int:
  """Return the index just past the group `text` opens with `(`."""
  depth = 0
  for i, ch in enumerate(text):
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      return i + 1
  raise ValueError(f"unbalanced HLO text: {text[:80]!r}")


def _instruction(rest: str) -> _Instruction:
  """Return the parts of the text right of an instruction's `=`."""
  end = _balanced(rest) if rest.startswith("(") else rest.index(" ")
  shape, tail = rest[:end], rest[end:].lstrip()
  opcode, _, call = tail.partition("(")
  close = _balanced("(" + call)
  operands = tuple(re.findall(r"%([\w.\-]+)", call[:close - 1]))
  return _Instruction(shape, opcode, operands, call[close - 1:],
                      call[:close - 2])


def parse_hlo(text: str) -> tuple[dict[str, dict[str, _Instruction]], str]:
  """Return every computation's instructions by name, and the entry's
  name, of an HLO module's text."""
  computations: dict[str, dict[str, _Instruction]] = {}
  current, entry = None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header.group(2), {})
      entry = header.group(2) if header.group(1) else entry
      continue
    m = _INSTRUCTION.match(line)
    if m and current is not None:
      current[m.group(1)] = _instruction(m.group(2))
  if entry is None:
    raise ValueError("HLO text has no ENTRY computation")
  return computations, entry


def _ints(text: str, key: str) -> list[int]:
  """Return the integer list `key={…}` (HLO) or `"key":[…]` (JSON)."""
  m = (re.search(rf"\b{key}=\{{([\d,]*)\}}", text)
       or re.search(rf'"{key}":\[([^\]]*)\]', text))
  return [int(v.strip('" ')) for v in m.group(1).split(",")
          if v.strip('" ')] if m else []


def dot_flops(lhs: list[int], rhs: list[int], rhs_contracting: list[int],
              rhs_batch: list[int]) -> float:
  """Return `2 · |lhs| · |rhs free dims|`, the FLOPs of one contraction."""
  free = [d for i, d in enumerate(rhs)
          if i not in rhs_contracting and i not in rhs_batch]
  return 2.0 * math.prod(lhs) * math.prod(free)


def _real_taps(n_in: int, n_out: int, size: int, stride: int, pad_low: int,
               lhs_dilate: int, rhs_dilate: int) -> int:
  """Return how many (output position, window tap) pairs of one spatial
  axis land on an input element rather than on padding or the holes of a
  dilated input."""
  last, total = (n_in - 1) * lhs_dilate, 0
  for o in range(n_out):
    base = o * stride - pad_low
    if rhs_dilate != 1:
      total += sum(1 for k in range(size) if 0 <= base + k * rhs_dilate
                   <= last and (base + k * rhs_dilate) % lhs_dilate == 0)
      continue
    low, high = max(0, -base), min(size - 1, last - base)
    if low <= high:  # taps k in [low, high] with (base + k) % lhs_dilate == 0
      r = -base % lhs_dilate
      total += (high - r) // lhs_dilate - (low - 1 - r) // lhs_dilate
  return total


def convolution_flops(lhs: list[int], kernel: list[int], output: list[int],
                      dim_labels: str, window: str = "") -> float:
  """Return the FLOPs of a convolution, 2 per multiply-add that lands on an
  input element: `2 · |output's batch and feature axes| · kernel[i] ·
  Π (real taps of each spatial axis)`. `dim_labels` (`lhs_rhs->out`, e.g.
  `bf_io->bf` or `01bf_01oi->01bf`) name the batch `b`, feature `f`, the
  kernel's input and output features `i`, `o` and the spatial axes
  (digits); `window` is the text of the instruction's `window={...}`.

  A TPU's compiler writes every dot as a convolution, and a dot's batch or
  free axes as spatial axes whose window taps mostly land on padding or
  the holes of a dilated input (`size=32 pad=31_31` over an input axis
  of 1; `size=8 lhs_dilate=8` over 8): counting only the taps that land
  on input makes such a convolution cost what its dot does. A feature
  group count leaves the kernel's `i` at one group's input features, and
  a batch group count splits the batch rather than the contraction, so
  the same product holds for both."""
  lhs_labels, rest = dim_labels.split("_")
  rhs_labels, out_labels = rest.split("->")
  if not (len(lhs_labels) == len(lhs) and len(rhs_labels) == len(kernel)
          and len(out_labels) == len(output) and "i" in rhs_labels):
    raise ValueError(f"dim_labels {dim_labels!r} do not fit shapes {lhs}, "
                     f"{kernel} -> {output}")
  fields = dict(re.findall(r"(\w+)=([\w\-]+)", window))
  spatial = sum(label.isdigit() for label in rhs_labels)

  def axis(key: str, j: int, default: str) -> str:
    return fields[key].split("x")[j] if key in fields else default

  taps, spatial_out = 1, 1
  for j in range(spatial):
    n_out = output[out_labels.index(str(j))]
    spatial_out *= n_out
    taps *= _real_taps(
      lhs[lhs_labels.index(str(j))], n_out, kernel[rhs_labels.index(str(j))],
      int(axis("stride", j, "1")), int(axis("pad", j, "0_0").split("_")[0]),
      int(axis("lhs_dilate", j, "1")), int(axis("rhs_dilate", j, "1")))
  return (2.0 * math.prod(output) // spatial_out
          * kernel[rhs_labels.index("i")] * taps)


def _own_flops(ins: _Instruction, shapes: dict[str, _Instruction]
               ) -> tuple[float, str | None]:
  """Return one instruction's matmul FLOPs (callees aside) and, when it
  may hold matmuls the count cannot size, what to call it."""
  if ins.opcode == "dot":
    lhs, rhs = (_dims(shapes[o].shape) for o in ins.operands[:2])
    return dot_flops(lhs, rhs, _ints(ins.attributes, "rhs_contracting_dims"),
                     _ints(ins.attributes, "rhs_batch_dims")), None
  if ins.opcode == "convolution":
    labels = re.search(r"dim_labels=([\w]+_[\w]+->[\w]+)", ins.attributes)
    if labels is None:
      return 0.0, "convolution"
    window = re.search(r"\bwindow=\{([^}]*)\}", ins.attributes)
    lhs, rhs = (_dims(shapes[o].shape) for o in ins.operands[:2])
    return convolution_flops(lhs, rhs, _dims(ins.shape), labels.group(1),
                             window.group(1) if window else ""), None
  if ins.opcode != "custom-call":
    return 0.0, None
  target = _TARGET.search(ins.attributes)
  name = target.group(1) if target else "custom-call"
  if name in _DATA_TARGETS:
    return 0.0, None
  if "gemm" in name or "matmul" in name:
    lhs, rhs = (_dims(shapes[o].shape) for o in ins.operands[:2])
    return dot_flops(lhs, rhs,
                     _ints(ins.attributes, "rhs_contracting_dimensions"),
                     _ints(ins.attributes, "rhs_batch_dimensions")), None
  scores = re.search(r'"intermediate_tensor_shape":\{[^{}]*?"dimensions":'
                     r'\[([^\]]*)\]', ins.attributes)
  if "fmha" in name and scores:
    head_dim = _dims(shapes[ins.operands[0]].shape)[-1]
    size = math.prod(int(v.strip('" ')) for v in scores.group(1).split(","))
    return (2.0 * size * head_dim * _FMHA_MATMULS["Backward" in name],
            None)
  return 0.0, name


def _constant(shapes: dict[str, _Instruction], name: str) -> int | None:
  """Return the integer constant `name` holds, through copies (None: it is
  no constant)."""
  ins = shapes.get(name)
  while ins is not None and ins.opcode == "copy":
    ins = shapes.get(ins.operands[0])
  if ins is None or ins.opcode != "constant":
    return None
  try:
    return int(ins.arguments)
  except ValueError:
    return None


def trip_count(loop: _Instruction,
               computations: dict[str, dict[str, _Instruction]],
               shapes: dict[str, _Instruction]) -> int | None:
  """Return a `while` loop's trip count (None: not known). A CPU's or GPU's
  compiler writes it in the loop's backend config; a TPU's leaves the loop
  as JAX lowered it, a condition `counter < N` on a state element started
  at a constant, so the count is read there (JAX's loops step by 1).
  `shapes` are the instructions of the computation holding the loop."""
  known = _TRIP.search(loop.attributes)
  if known:
    return int(known.group(1))
  cond = re.search(r"\bcondition=%?([\w.\-]+)", loop.attributes)
  body = computations.get(cond.group(1), {}) if cond else {}
  compares = [ins for ins in body.values() if ins.opcode == "compare"
              and "direction=LT" in ins.attributes]
  if len(compares) != 1 or len(compares[0].operands) != 2:
    return None
  counter, bound = (body.get(o) for o in compares[0].operands)
  index = re.search(r"\bindex=(\d+)", counter.attributes) if counter else None
  state = shapes.get(loop.operands[0]) if loop.operands else None
  if (index is None or counter.opcode != "get-tuple-element"
      or state is None or state.opcode != "tuple"
      or int(index.group(1)) >= len(state.operands)):
    return None
  start = _constant(shapes, state.operands[int(index.group(1))])
  end = _constant(body, compares[0].operands[1])
  return None if start is None or end is None else max(0, end - start)


def compiled_matmul_flops(hlo_text: str) -> HloMatmuls:
  """Return the matmul FLOPs of a compiled program's optimized HLO text
  (`compiled.as_text()`), each loop body counted its trip count times and
  a conditional by its costliest branch."""
  computations, entry = parse_hlo(hlo_text)
  uncounted: dict[str, int] = {}
  memo: dict[str, tuple[float, float]] = {}

  def note(what: str) -> None:
    uncounted[what] = uncounted.get(what, 0) + 1

  def total(name: str) -> tuple[float, float]:
    """Return a computation's FLOPs and the part in XLA's remat clones."""
    if name not in memo:
      flops = remat = 0.0
      for ins_name, ins in computations[name].items():
        counted = instruction(ins, computations[name])
        flops += counted[0]
        remat += counted[0] if _REMAT.search(ins_name) else counted[1]
      memo[name] = flops, remat
    return memo[name]

  def instruction(ins: _Instruction, shapes: dict[str, _Instruction]
                  ) -> tuple[float, float]:
    return _sum_pairs(own(ins, shapes), called(ins, shapes))

  def own(ins: _Instruction, shapes: dict[str, _Instruction]
          ) -> tuple[float, float]:
    flops, missed = _own_flops(ins, shapes)
    if missed:
      note(missed)
    return flops, 0.0

  def called(ins: _Instruction, shapes: dict[str, _Instruction]
             ) -> tuple[float, float]:
    trips = 1
    if ins.opcode == "while":
      known = trip_count(ins, computations, shapes)
      if known is None:
        note("loop of unknown trip count")
      trips = 1 if known is None else known
    branches = [n.strip().lstrip("%") for m in _BRANCHES.finditer(
      ins.attributes) for n in (m.group(1) or m.group(2)).split(",")]
    costliest = max((total(b) for b in branches), default=(0.0, 0.0),
                    key=lambda pair: pair[0])
    callees = _sum_pairs(*(total(c) for c in
                           _CALLEES.findall(ins.attributes)))
    return _sum_pairs(costliest, tuple(trips * v for v in callees))

  flops, remat = total(entry)
  return HloMatmuls(flops, uncounted, remat)


def _sum_pairs(*pairs: tuple[float, float]) -> tuple[float, float]:
  return (sum((p[0] for p in pairs), 0.0), sum((p[1] for p in pairs), 0.0))


def xla_cost_flops(compiled: Any) -> float:
  """Return `compiled.cost_analysis()`'s FLOPs (every loop body once)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float((cost or {}).get("flops", float("nan")))


def loop_trips(hlo_text: str) -> list[int]:
  """Return the known trip count of every loop of a compiled program's
  optimized HLO text, random-number loops (threefry) aside."""
  computations, _ = parse_hlo(hlo_text)
  return [trips for instructions in computations.values()
          for ins in instructions.values() if ins.opcode == "while"
          and "threefry" not in ins.attributes
          and (trips := trip_count(ins, computations, instructions))
          is not None]


def measured_matmul_rate(dtype: Any = jnp.float32, n: int = 1024,
                         repeats: int = 10) -> float:
  """Return the FLOP/s of a jitted `n×n @ n×n` matmul in `dtype` on the
  default device, median of `repeats` (the CPU's stand-in for a peak)."""
  a, b = (jax.random.normal(k, (n, n), dtype)
          for k in jax.random.split(jax.random.key(0)))
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2.0 * n**3 / statistics.median(times)
