"""What an attribution graph costs: `./dev bench attribution_graph`.

A graph is `explore.attribution_graph` on one prompt of
`--attribution_prompt_len` random token ids: the output logit of the clean
top prediction at the last position, expanded to at most
`--attribution_max_targets` targets in batches of `--attribution_chunk`
(one batched backward pass each). The bench times the first graph (trace
and compile included) and then `--attribution_repeats` graphs of other
prompts through the compiled programs, and reports the median and the
fastest, with the graph's size and the median process CPU time (the
machine's other load does not inflate it).

By default the model is `bench.intervention`'s small Llama of random
weights with one block's MLP decomposed; `--attribution_run_dir` times a
finished run instead (the Brown CPU model: `runs/brown_s`). (Flag names
apart from the other binaries': tests load several into one process.)
"""

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from decompax.analysis import explore

from bench import intervention

_REPEATS = flags.DEFINE_integer("attribution_repeats", 5, "Timed graphs "
                                "after the first.", lower_bound=1)
_PROMPT = flags.DEFINE_integer("attribution_prompt_len", 64, "Tokens in "
                               "the prompt.", lower_bound=1)
_TARGETS = flags.DEFINE_integer("attribution_max_targets", 64, "Targets "
                                "expanded per graph.", lower_bound=1)
_CHUNK = flags.DEFINE_integer("attribution_chunk", 16, "Targets per "
                              "backward batch.", lower_bound=1)
_SHARE = flags.DEFINE_float("attribution_share", 0.9, "Share of each "
                            "target's incoming |attribution| kept.")
_RUN_DIR = flags.DEFINE_string(
  "attribution_run_dir", None, "A finished run to time instead of the "
  "random model.")


def time_graphs(run: explore.LoadedRun, vocab: int, prompt_len: int,
                repeats: int, **graph_args) -> dict:
  """Return the first graph's seconds (compile included), the median and
  fastest of `repeats` more on other prompts, and the first graph and its
  prompt (`graph_args` go to `explore.attribution_graph`)."""

  def graph(seed):
    tokens = jax.random.randint(jax.random.key(seed), (prompt_len,), 0,
                                vocab, jnp.int32)
    start, cpu = time.perf_counter(), time.process_time()
    g = explore.attribution_graph(run, tokens, **graph_args)
    return (time.perf_counter() - start, time.process_time() - cpu, g,
            tokens)

  first_s, _, first, tokens = graph(0)
  times, cpus, _, _ = zip(*(graph(i + 1) for i in range(repeats)))
  return {"first_s": first_s, "median_s": statistics.median(times),
          "min_s": min(times), "cpu_s": statistics.median(cpus),
          "graph": first, "tokens": tokens}


def main(argv: list[str]) -> None:
  del argv
  if _RUN_DIR.value:
    run = explore.load_run(_RUN_DIR.value)
    vocab, what = explore.vocab_size(run), _RUN_DIR.value
  else:
    model = intervention.MODEL
    run = intervention.random_run(model, intervention.LAYER, intervention.C,
                                  _PROMPT.value)
    vocab, what = model.vocab_size, (f"random Llama {model.n_layers}x"
                                     f"{model.d_model}, block "
                                     f"{intervention.LAYER} MLP, "
                                     f"C={intervention.C}")
  result = time_graphs(run, vocab, _PROMPT.value, _REPEATS.value,
                       share=_SHARE.value, max_targets=_TARGETS.value,
                       chunk=_CHUNK.value)
  g = result["graph"]
  print(f"{what}: attribution graph of a {_PROMPT.value}-token prompt, "
        f"{len(run.target.sites)} sites, at most {_TARGETS.value} targets "
        f"in batches of {_CHUNK.value}, share {_SHARE.value}")
  print(f"  graph: {len(g.nodes)} nodes, {len(g.edges)} edges")
  print(f"  first (trace + compile): {result['first_s']:.3f} s")
  print(f"  compiled: median {result['median_s']:.3f} s, fastest "
        f"{result['min_s']:.3f} s over {_REPEATS.value}; median CPU time "
        f"{result['cpu_s']:.3f} s (all threads: on idle cores the wall "
        "time is about this over their number)")


if __name__ == "__main__":
  app.run(main)
