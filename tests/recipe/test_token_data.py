"""A run's token files: none without `--data_path`, batches of the run's
geometry read from the file, held-out windows from the same file unless
another is given, and a file shorter than one sequence refused."""

import numpy as np
import pytest

from decompax.io import tokens as tokens_lib
from decompax.recipe import token_data

VOCAB = 50


@pytest.fixture
def token_file(tmp_path):
  rng = np.random.default_rng(0)
  documents = [rng.integers(0, VOCAB - 1, 40) for _ in range(5)]
  path = tmp_path / "train.bin"
  tokens_lib.write_tokens(path, documents, VOCAB, VOCAB - 1, "test")
  return str(path)


def test_no_data_path_means_random_ids(parse):
  assert token_data.open_data(parse("--batch_size=4"), VOCAB) is None
  assert "uniform random token ids" in token_data.describe(None)


def test_batches_have_the_runs_geometry_and_come_from_the_file(token_file):
  data = token_data.open_files(token_file, None, VOCAB, 0, 1, 4, 8)
  assert data.eval is data.train
  assert "eval windows from the same file" in token_data.describe(data)
  batch = np.asarray(token_data.train_batch(data, 3))
  assert batch.shape == (4, 8) and batch.max() < VOCAB
  np.testing.assert_array_equal(batch, token_data.train_batch(data, 3))
  held_out = np.asarray(token_data.eval_batches(data, 2))
  assert held_out.shape == (2, 4, 8)
  assert token_data.example_batch(data).shape == (4, 8)


def test_a_file_shorter_than_a_sequence_is_refused(token_file):
  with pytest.raises(ValueError, match="fewer than one --seq_len=999"):
    token_data.open_files(token_file, None, VOCAB, 0, 1, 4, 999)
