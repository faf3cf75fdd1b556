"""Named sets of XLA options for compiling a training step.

A preset is a plain `{option: value}` mapping handed to `.compile()`; each
backend reads its own options and ignores the others', so one preset can
serve CPU and GPU runs alike. `bin/train` takes `--compiler` (a preset name
or `xla_option=value` pairs) and the step-time bench times the same names.
"""

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
  "bare": {},
  # XLA's CPU code generator caps its vector loops at 256 bits by default,
  # for CPUs that lower their clock under 512-bit instructions. On an
  # AVX-512 machine without that penalty the step's elementwise loops are
  # the bulk of a toy step, and 512 bits made the three toy recipes 1.0-1.12x
  # faster in one interleaved run (docs/performance.md). LLVM never goes
  # past what the CPU has, so AVX2-only machines keep 256-bit loops.
  "cpu512": {"xla_cpu_prefer_vector_width": 512},
  # GPU collective scheduling and combining for sharded steps.
  "tuned-v1": {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_all_reduce_combine_threshold_bytes": 134217728,
    "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 134217728,
  },
}

DEFAULT = "cpu512"


def _parse_value(text: str) -> bool | int | float | str:
  lowered = text.strip().lower()
  if lowered in ("true", "false"):
    return lowered == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text.strip()


def options(text: str) -> dict[str, Any]:
  """Return the XLA options of a preset name or of `name=value,…`; raise
  ValueError, naming the presets, for anything else."""
  if text in PRESETS:
    return dict(PRESETS[text])
  parsed = {}
  for item in filter(None, (i.strip() for i in text.split(","))):
    name, sep, value = item.partition("=")
    if not sep or not name.strip().startswith("xla_"):
      raise ValueError(
        f"--compiler={text!r}: use {', '.join(PRESETS)} or "
        "xla_option=value pairs separated by commas")
    parsed[name.strip()] = _parse_value(value)
  return parsed
