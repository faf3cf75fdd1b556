"""Matmul FLOPs and loops of a compiled program, read from its optimized
HLO text (`compiled.as_text()`), and a matmul rate to hold them against.

`compiled_matmul_flops` counts contractions only, 2 FLOPs per
multiply-add: `dot`s, wherever fusion put them, and the GPU library calls
that stand for them (cuBLAS GEMMs sized by their dimension numbers, cuDNN
flash attention by its score matrix). It multiplies every loop body by its
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
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# cuDNN flash attention: 2 score-sized matmuls forward; backward the 4
# gradient matmuls and the scores it recomputes.
_FMHA_MATMULS = {False: 2, True: 5}


class HloMatmuls(NamedTuple):
  """A compiled program's matmul FLOPs; `uncounted` names, with their
  counts, the instructions that may hold matmuls the count could not size
  (convolutions, unknown custom calls, loops of unknown trip count)."""

  flops: float
  uncounted: dict[str, int]


class _Instruction(NamedTuple):
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str


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
  return _Instruction(shape, opcode, operands, call[close - 1:])


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


def _own_flops(ins: _Instruction, shapes: dict[str, _Instruction]
               ) -> tuple[float, str | None]:
  """Return one instruction's matmul FLOPs (callees aside) and, when it
  may hold matmuls the count cannot size, what to call it."""
  if ins.opcode == "dot":
    lhs, rhs = (_dims(shapes[o].shape) for o in ins.operands[:2])
    return dot_flops(lhs, rhs, _ints(ins.attributes, "rhs_contracting_dims"),
                     _ints(ins.attributes, "rhs_batch_dims")), None
  if ins.opcode == "convolution":
    return 0.0, "convolution"
  if ins.opcode != "custom-call":
    return 0.0, None
  target = _TARGET.search(ins.attributes)
  name = target.group(1) if target else "custom-call"
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


def compiled_matmul_flops(hlo_text: str) -> HloMatmuls:
  """Return the matmul FLOPs of a compiled program's optimized HLO text
  (`compiled.as_text()`), each loop body counted its trip count times and
  a conditional by its costliest branch."""
  computations, entry = parse_hlo(hlo_text)
  uncounted: dict[str, int] = {}
  memo: dict[str, float] = {}

  def note(what: str) -> None:
    uncounted[what] = uncounted.get(what, 0) + 1

  def total(name: str) -> float:
    if name not in memo:
      memo[name] = sum(instruction(ins, computations[name])
                       for ins in computations[name].values())
    return memo[name]

  def instruction(ins: _Instruction,
                  shapes: dict[str, _Instruction]) -> float:
    flops, missed = _own_flops(ins, shapes)
    if missed:
      note(missed)
    trips = 1
    if ins.opcode == "while":
      m = _TRIP.search(ins.attributes)
      if m is None:
        note("loop of unknown trip count")
      trips = int(m.group(1)) if m else 1
    branches = [n.strip().lstrip("%") for m in _BRANCHES.finditer(
      ins.attributes) for n in (m.group(1) or m.group(2)).split(",")]
    if branches:
      flops += max(total(b) for b in branches)
    return flops + trips * sum(total(c) for c in
                               _CALLEES.findall(ins.attributes))

  return HloMatmuls(total(entry), uncounted)


def xla_cost_flops(compiled: Any) -> float:
  """Return `compiled.cost_analysis()`'s FLOPs (every loop body once)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float((cost or {}).get("flops", float("nan")))


def loop_trips(hlo_text: str) -> list[int]:
  """Return the known trip count of every loop of a compiled program's
  optimized HLO text, random-number loops (threefry) aside."""
  computations, _ = parse_hlo(hlo_text)
  return [int(m.group(1)) for instructions in computations.values()
          for ins in instructions.values() if ins.opcode == "while"
          and "threefry" not in ins.attributes
          and (m := _TRIP.search(ins.attributes))]


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
