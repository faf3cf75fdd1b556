"""The work each instruction of a compiled XLA module does, read from its text.

A helper of `bench/profile.py` (no `main`): `parse_hlo` reads
`compiled.as_text()`; the other functions take an instruction's name, as a
thunk of the executed program is named, and return its category, its matmul
FLOPs, its elementwise operations by opcode, the bytes of its operands and
result, and the source line it came from. Instruction names are unique in a
module; a loop's body counts as many times as its known trip count.

Categories: an instruction holding a dot or convolution (itself or in a
computation it calls) is `matmul`; else one holding a reduce is
`reduction`; else one that only moves data (copy, transpose, slice,
broadcast...) is `layout`; else `elementwise`. Names the module lacks are
`unknown`.
"""

import collections
import math
import pathlib
import re
from collections.abc import Iterable
from typing import NamedTuple

from bench import hlo_flops


ROOT = pathlib.Path(__file__).resolve().parents[1]
MATMUL_OPS = {"dot", "convolution"}
REDUCTION_OPS = {"reduce", "reduce-window", "select-and-scatter", "scatter"}
DATA_MOVEMENT_OPS = {
  "copy", "transpose", "bitcast", "reshape", "broadcast", "slice",
  "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "reverse",
  "parameter", "constant", "tuple", "get-tuple-element", "copy-start",
  "copy-done"}
# Instructions that only run others; their work is their callees'.
CALLERS = {"fusion", "call", "while", "conditional"}

_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|"
                     r"false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b(pred|bf16|[fsuc]\d+\w*)\[([\d,]*)\]")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


class Instruction(NamedTuple):
  """One HLO instruction as the module's text prints it."""
  opcode: str
  shape: str  # the result's type text; a tuple lists each array
  operands: tuple[str, ...]
  called: tuple[str, ...]  # computations it runs (fusion, loop, branches)
  attributes: str  # everything after the operand list


class Hlo(NamedTuple):
  """A compiled module: its instructions by name, the instruction names of
  each computation, and each stack frame's `file:line`."""
  module: str
  instructions: dict[str, Instruction]
  computations: dict[str, tuple[str, ...]]
  sources: dict[int, str]


def _split_operands(text: str) -> tuple[str, str]:
  """Return the operand list (up to its closing parenthesis) and the rest."""
  depth = 1
  for i, char in enumerate(text):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return text[:i], text[i + 1:]
  return text, ""


def _short_path(path: str) -> str:
  """Return `path` from its installed package, or from the repository root."""
  if "site-packages/" in path:
    return path.rpartition("site-packages/")[2]
  return path.removeprefix(str(ROOT) + "/")


def _ids(row: str) -> dict[str, int]:
  return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", row)}


def _frame_sources(lines: Iterable[str]) -> dict[int, str]:
  """Return `file:line` of each stack frame id in the module's tables."""
  tables, section = collections.defaultdict(dict), None
  for line in lines:
    row = re.match(r"(\d+) (.*)", line) if section else None
    if row:
      tables[section][int(row[1])] = row[2]
    section = line if line in _TABLES else (section if row else None)
  files = {k: _short_path(v.strip('"'))
           for k, v in tables["FileNames"].items()}
  places = {k: f"{files.get(_ids(v)['file_name_id'], '?')}:"
               f"{_ids(v)['line']}"
            for k, v in tables["FileLocations"].items()}
  return {k: places.get(_ids(v)["file_location_id"], "?")
          for k, v in tables["StackFrames"].items()}


def parse_hlo(text: str) -> Hlo:
  """Return the instructions and computations of `compiled.as_text()`."""
  lines = text.splitlines()
  module = lines[0].split()[1].rstrip(",") if lines else ""
  instructions, computations, current = {}, collections.defaultdict(list), ""
  for line in lines:
    if match := _INSTRUCTION.match(line):
      name, shape, opcode, rest = match.groups()
      operands, attributes = _split_operands(rest)
      called = _CALLED.findall(attributes)
      for branches in _BRANCHES.findall(attributes):
        called += re.findall(r"%([\w.\-]+)", branches)
      instructions[name] = Instruction(
        opcode, shape, tuple(re.findall(r"%([\w.\-]+)", operands)),
        tuple(called), attributes)
      computations[current].append(name)
    elif match := _COMPUTATION.match(line):
      current = match[1]
  return Hlo(module, instructions,
             {k: tuple(v) for k, v in computations.items()},
             _frame_sources(lines))


def _arrays(shape: str) -> list[tuple[int, list[int]]]:
  """Return (bytes per element, dims) of each array in a type text."""
  found = []
  for dtype, dims in _ARRAY.findall(shape):
    bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype)[0])
    found.append((max(1, bits // 8), [int(d) for d in dims.split(",") if d]))
  return found


def _bytes(shape: str) -> int:
  return sum(size * math.prod(dims) for size, dims in _arrays(shape))


def _elements(shape: str) -> int:
  return sum(math.prod(dims) for _, dims in _arrays(shape))


def _dims(attributes: str, key: str) -> list[int]:
  match = re.search(key + r"=\{([\d,]*)\}", attributes)
  return [int(d) for d in match[1].split(",") if d] if match else []


def _opcodes_within(hlo: Hlo, name: str) -> set[str]:
  """Return the opcodes of an instruction and of all it calls."""
  instruction = hlo.instructions[name]
  found = {instruction.opcode}
  for computation in instruction.called:
    for inner in hlo.computations.get(computation, ()):
      found |= _opcodes_within(hlo, inner)
  return found


def category(hlo: Hlo, name: str) -> str:
  """Return the category of instruction `name` (see the module docstring)."""
  if name not in hlo.instructions:
    return "unknown"
  opcodes = _opcodes_within(hlo, name)
  if opcodes & MATMUL_OPS:
    return "matmul"
  if opcodes & REDUCTION_OPS:
    return "reduction"
  if opcodes <= DATA_MOVEMENT_OPS:
    return "layout"
  return "elementwise"


def _callees_sum(hlo: Hlo, instruction: Instruction, of) -> collections.Counter:
  """Return `of(name)` summed over the instructions `instruction` calls: the
  costlier branch of a conditional, a loop's body times its trip count."""
  per_computation = []
  for computation in instruction.called:
    total = collections.Counter()
    for inner in hlo.computations.get(computation, ()):
      total.update(of(inner))
    per_computation.append(total)
  if not per_computation:
    return collections.Counter()
  if instruction.opcode == "conditional":
    return max(per_computation, key=lambda c: sum(c.values()))
  trips = _TRIP_COUNT.search(instruction.attributes)
  total = sum(per_computation, collections.Counter())
  return collections.Counter(
    {k: v * (int(trips[1]) if trips else 1) for k, v in total.items()})


def _contraction_flops(hlo: Hlo, instruction: Instruction) -> float:
  """Return 2 × result elements × contracted elements of a dot or conv."""
  result = _elements(instruction.shape)
  if instruction.opcode == "dot":
    lhs = _arrays(hlo.instructions[instruction.operands[0]].shape)[0][1]
    contracted = math.prod(
      lhs[d] for d in _dims(instruction.attributes, "lhs_contracting_dims"))
  else:
    # Only the taps that land on input: a TPU writes dots as convolutions
    # whose windows mostly cover padding (`hlo_flops.convolution_flops`).
    lhs, kernel = (_arrays(hlo.instructions[o].shape)[0][1]
                   for o in instruction.operands[:2])
    labels = re.search(r"dim_labels=(\w+_\w+->\w+)", instruction.attributes)
    window = re.search(r"\bwindow=\{([^}]*)\}", instruction.attributes)
    if labels is None:
      return 2.0 * result * math.prod(kernel)
    return hlo_flops.convolution_flops(
      lhs, kernel, _arrays(instruction.shape)[0][1], labels[1],
      window[1] if window else "")
  return 2.0 * result * contracted


def matmul_flops(hlo: Hlo, name: str) -> float:
  """Return the FLOPs of the dots and convolutions `name` runs."""
  instruction = hlo.instructions.get(name)
  if instruction is None:
    return 0.0
  if instruction.opcode in MATMUL_OPS:
    return _contraction_flops(hlo, instruction)
  flops = _callees_sum(
    hlo, instruction, lambda inner: {"": matmul_flops(hlo, inner)})
  return float(flops[""])


def elementwise_ops(hlo: Hlo, name: str) -> collections.Counter:
  """Return the elementwise operations `name` runs, as elements by opcode:
  one per result element, one per input element of a reduction; data
  movement and matmuls excluded."""
  instruction = hlo.instructions.get(name)
  if instruction is None:
    return collections.Counter()
  if instruction.opcode in CALLERS:
    return _callees_sum(hlo, instruction,
                        lambda inner: elementwise_ops(hlo, inner))
  if instruction.opcode in DATA_MOVEMENT_OPS | MATMUL_OPS:
    return collections.Counter()
  shape = instruction.shape
  if instruction.opcode in REDUCTION_OPS and instruction.operands:
    shape = hlo.instructions[instruction.operands[0]].shape
  return collections.Counter({instruction.opcode: _elements(shape)})


def bytes_moved(hlo: Hlo, name: str) -> int:
  """Return the bytes of an instruction's result and operands."""
  instruction = hlo.instructions.get(name)
  if instruction is None:
    return 0
  return _bytes(instruction.shape) + sum(
    _bytes(hlo.instructions[o].shape) for o in instruction.operands
    if o in hlo.instructions)


def source(hlo: Hlo, name: str) -> str:
  """Return where an instruction comes from: its op path and source line."""
  instruction = hlo.instructions.get(name)
  if instruction is None:
    return ""
  op = _OP_NAME.search(instruction.attributes)
  frame = _FRAME.search(instruction.attributes)
  op_path = op[1].partition(")/")[2] if op else ""
  place = hlo.sources.get(int(frame[1]), "") if frame else ""
  return f"{op_path} {place}".strip()
