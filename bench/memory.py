"""Static per-device memory of the Llama-3.1-8B layer-18 train step (SPEC §8),
or of a Pythia-1.4B- or Qwen3-30B-A3B-shaped one (`--model=pythia-1.4b`,
`--model=qwen3-30b-a3b`).

Run: `./dev bench memory`.
Everything is abstract (`jax.ShapeDtypeStruct`s, no weights): the step of
the reference recipe exactly as `flags/l18.flags` builds it (SPEC §6.7:
sites `layers.18.mlp.{gate,up,down}_proj`, C = 24576, bf16 frozen weights
of all 32 layers, the chunkwise-transformer CI at its reference sizes),
at a global batch of `--global_batch` sequences, placed by each preset on
`--mesh` simulated CPU devices and compiled for CPU. It reports XLA's memory analysis of the compiled step per
device (argument, output, temporary bytes, and the donated bytes aliased
between arguments and outputs) and, from the placement alone, each device's
share of the state: V/U masters plus their AdamW moments, and CI weights
plus theirs. It then checks that `zero1` and `owner` divide the optimizer
state by the fsdp size. `--place` (as bin/train's) overrides categories of
every preset. The run is assembled as `bin/train` assembles it
(`recipe.assembly.parts` and `plan`).

The CPU compile overstates an accelerator's temp: `--attention=auto`
resolves to XLA's attention, which materialises fp32 `[b, heads, t, t]`
probabilities (cuDNN's fused kernel does not), bf16 collectives are staged
through fp32 copies, and gradient reductions are full-size all-reduces
rather than reduce-scatters.

`--model=pythia-1.4b` builds the same recipe on Pythia-1.4B's config
(`tests/fixtures/hf_configs/pythia-1.4b`, design §9.4): its layer-12 MLP,
`up_proj` and `down_proj` (a plain MLP has no gate), C = 16384 (2·d_ff),
with the frozen biases and untied head among the bf16 weights.

`--model=qwen3-30b-a3b` builds it on Qwen3-30B-A3B's config
(`tests/fixtures/hf_configs/qwen3-30b-a3b`, design §9.5): every expert's
gate, up and down of layer 24 (384 sites; the router frozen), C = 192
each, the reference recipe's 73728 components a layer spread over its
expert matrices. The forward runs all 128 experts at every position with
the unrouted ones weighted 0 (no gather), so its transients are `[b, 128,
t, 768]` per layer where a routed forward's would be 16 times smaller.
"""

import math
import sys
import time

from absl import app, flags

from bench import memory_models

_MESH = flags.DEFINE_string("mesh", "1,8,1", "replicate,fsdp,tp sizes.")
_PRESETS = flags.DEFINE_list("presets", ["ddp", "zero1", "owner"],
                             "Placement presets to compare.")
# Named apart from bin/train's flags, which the recipe's flagfile sets.
_BATCH = flags.DEFINE_integer("global_batch", 8, "Global batch (sequences).")
_SEQ_LEN = flags.DEFINE_integer("seq_length", 2048, "Tokens per sequence.")
_MODEL = flags.DEFINE_enum("model", "llama-3.1-8b",
                           list(memory_models.MODELS),
                           "Model config (tests/fixtures/hf_configs/).")
_C = flags.DEFINE_integer("components", None, "Components per matrix "
                          "(default: the model's, MODELS).")
_LAYER = flags.DEFINE_integer("layer", None, "Decomposed MLP's layer "
                              "(default: the model's, MODELS).")
_PLACE = flags.DEFINE_list(
  "place", [], "Per-category overrides of every preset, as bin/train's "
  "--place (category:layout,...).")

MODELS, GIB = memory_models.MODELS, memory_models.GIB


def per_device_bytes(tree, shardings) -> int:
  """Return one device's bytes of `tree` laid out by `shardings`."""
  import jax
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shard = sharding.shard_shape(leaf.shape)
    total += math.prod(shard) * leaf.dtype.itemsize
  return total


def measure(preset: str, mesh_sizes, parts, weights,
            overrides: tuple[str, ...] = ()) -> dict:
  """Return the memory analysis and state shares of one preset."""
  import jax
  from jax.sharding import AxisType
  from decompax.placement import shardings
  from decompax.placement import table as table_lib
  from decompax.recipe import assembly

  # Meshes are the binaries' to build, as bin/train does.
  mesh = jax.make_mesh(mesh_sizes, table_lib.MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(mesh_sizes),
                       devices=jax.devices()[:math.prod(mesh_sizes)])
  planned = assembly.plan(parts, weights, shardings.Placement(
    mesh, table_lib.make_table(preset, overrides)))
  state, placed = planned.state, planned.shardings
  start = time.time()
  key = jax.eval_shape(lambda: jax.random.key(0))
  compiled = planned.step.step.lower(state, weights, key).compile()
  stats = compiled.memory_analysis()
  s = placed.state
  return {
    "preset": preset,
    "argument": stats.argument_size_in_bytes,
    "output": stats.output_size_in_bytes,
    "alias": stats.alias_size_in_bytes,
    "temp": stats.temp_size_in_bytes,
    "vu_state": per_device_bytes((state.components, state.components_opt),
                                 (s.components, s.components_opt)),
    "vu_opt": per_device_bytes(state.components_opt, s.components_opt),
    "ci_state": per_device_bytes((state.ci_params, state.ci_opt),
                                 (s.ci_params, s.ci_opt)),
    "frozen": per_device_bytes(weights, placed.weights),
    "compile_s": time.time() - start,
  }


def main(argv):
  del argv
  mesh_sizes = tuple(int(n) for n in _MESH.value.split(","))
  presets = list(_PRESETS.value)
  model = _MODEL.value
  title, default_layer, default_c = MODELS[model]
  layer = default_layer if _LAYER.value is None else _LAYER.value
  overrides = tuple(_PLACE.value)
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", math.prod(mesh_sizes))
  config = memory_models.recipe(_BATCH.value, _SEQ_LEN.value,
                   default_c if _C.value is None else _C.value)
  parts, weights = memory_models.build(config, layer, model)
  lead = parts.lead_shape
  print(f"{title} layer {layer} MLP ({len(parts.target.sites)} sites), "
        f"C={config.c}, batch "
        f"{lead[0]}x{lead[1]}, mesh replicate,fsdp,tp = "
        f"{','.join(map(str, mesh_sizes))}"
        f"{'; --place=' + ','.join(overrides) if overrides else ''}; "
        "GiB per device")
  header = ("preset", "argument", "output", "alias", "temp", "V/U+opt",
            "V/U opt", "CI+opt", "frozen", "compile s")
  print(" | ".join(header))
  rows = []
  for preset in presets:
    row = measure(preset, mesh_sizes, parts, weights, overrides)
    rows.append(row)
    print(" | ".join([preset] + [f"{row[k] / GIB:.2f}" for k in (
      "argument", "output", "alias", "temp", "vu_state", "vu_opt",
      "ci_state", "frozen")] + [f"{row['compile_s']:.0f}"]), flush=True)
  fsdp = mesh_sizes[1]
  by_preset = {r["preset"]: r for r in rows}
  failed = False
  if "ddp" in by_preset:
    for preset in ("zero1", "owner"):
      if preset in by_preset:
        ratio = by_preset["ddp"]["vu_opt"] / by_preset[preset]["vu_opt"]
        ok = ratio >= fsdp * (1 - 1e-6)
        failed |= not ok
        print(f"{preset}: optimizer state {ratio:.3f}x smaller than ddp "
              f"(fsdp = {fsdp}): {'ok' if ok else 'FAILED'}")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  app.run(main)
