"""Token strings for the report's LM component table (`render/run_report`).

`token_decoder(model_dir)` turns one token id into the text the checkpoint's
own tokenizer gives it, read from the local model directory (no network).
The report escapes the strings and marks spaces and line breaks; here they
stay raw. Without a usable tokenizer the table shows ids, and the console
says so once.
"""

import functools
from collections.abc import Callable

import jax

from decompax.io import hf_checkpoint


def _ids_only(why: str) -> Callable[[int], str]:
  if jax.process_index() == 0:
    print(f"[report] {why}; contexts show token ids", flush=True)
  return str


def token_decoder(model_dir: str) -> Callable[[int], str]:
  """Return `id -> text` of the tokenizer in `model_dir`, or `str` of the id
  (announced on the console) when the directory holds no loadable one.

  An id the tokenizer decodes to nothing (past its vocabulary, or an empty
  token) shows as `<id>`, so that no context position is invisible.
  """
  if not hf_checkpoint.has_tokenizer(model_dir):
    return _ids_only(f"no tokenizer in {model_dir}")
  try:
    tokenizer = hf_checkpoint.read_tokenizer(model_dir)
  except ValueError as e:
    return _ids_only(str(e))

  @functools.cache
  def decode(token_id: int) -> str:
    return tokenizer.decode([token_id]) or f"<{token_id}>"

  return decode
