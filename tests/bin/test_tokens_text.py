"""bin/tokens_text: the local tokenizer's strings in the LM component table."""

import pathlib

import numpy as np
import pytest

from decompax.bin import tokens_text
from decompax.render import run_report as report

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
# Byte-level forms, as Llama-3 and Qwen3 store them: `Ġ` is a leading
# space, `Ċ` a newline, `ĉ` a tab.
VOCAB = {"<eos>": 0, "the": 1, "Ġcat": 2, "Ġsat": 3, "Ċ": 4, "<b>": 5,
         "ĉon": 6}
TEXTS = ["<eos>", "the", " cat", " sat", "\n", "<b>", "\ton"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A directory holding a saved Hugging Face tokenizer of `VOCAB`."""
  # Imported here: slow, and only these tests use them.
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  word_level = Tokenizer(models.WordLevel(VOCAB, unk_token="<eos>"))
  word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  word_level.decoder = decoders.ByteLevel()
  path = tmp_path_factory.mktemp("model")
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=word_level, eos_token="<eos>").save_pretrained(path)
  return str(path)


def test_decoder_gives_each_id_its_tokenizer_string(model_dir, capsys):
  decode = tokens_text.token_decoder(model_dir)
  assert [decode(i) for i in range(len(VOCAB))] == TEXTS
  assert decode(99) == "<99>"  # past the vocabulary: never an empty cell
  assert "[report]" not in capsys.readouterr().out


def test_component_table_html_shows_the_decoded_context(model_dir):
  decode = tokens_text.token_decoder(model_dir)
  tokens = np.array([[[1, 2, 3, 6, 4, 5]]])  # [n_batches, B, T]
  # The one component's highest CI is at position 2 (" sat").
  top = {"s": (np.array([[0.9]]), np.array([[0]]), np.array([[2]]))}
  table = report.component_table(tokens, top, {"s": np.array([0.5])},
                                 {"s": np.array([0.3])}, decode,
                                 before=2, after=3)
  assert table["s"][0].contexts[0].tokens == tuple(TEXTS[i]
                                                   for i in tokens[0, 0])
  page = report.render_html("run", "", [], [], [], table, "now")
  assert ("<td class=before><code>the&middot;cat</code></td><td class=focus>"
          "<code><mark>&middot;sat</mark></code></td><td class=after><code>"
          "&rarr;on&crarr;&lt;b&gt;</code></td>") in page


def test_a_model_without_tokenizer_shows_ids_and_says_so_once(capsys):
  model = str(FIXTURES / "tiny_llama")  # config and weights only
  decode = tokens_text.token_decoder(model)
  assert [decode(i) for i in (17, 0, 17)] == ["17", "0", "17"]
  out = capsys.readouterr().out
  assert out == (f"[report] no tokenizer in {model}; contexts show token "
                 "ids\n")


def test_an_unreadable_tokenizer_shows_ids_and_says_why(tmp_path, capsys):
  (tmp_path / "tokenizer_config.json").write_text("{ not json")
  decode = tokens_text.token_decoder(str(tmp_path))
  assert decode(3) == "3"
  out = capsys.readouterr().out
  assert out.startswith(f"[report] cannot read a tokenizer from {tmp_path}")
  assert out.endswith("; contexts show token ids\n") and out.count("\n") == 1
