"""A small state's leaves in one `.npz`: saved and loaded back into the
template's structure with its metadata, and a file of another tree is
refused."""

import numpy as np
import pytest

from decompax.io import tree_npz

TREE = {"a": np.arange(3.0), "b": (np.ones((2, 2), np.int32), np.zeros(1))}


def test_a_tree_and_its_metadata_round_trip(tmp_path):
  path = tree_npz.save_tree(tmp_path / "state.npz", TREE, {"step": 4})
  loaded, meta = tree_npz.load_tree(path, TREE)
  assert meta == {"step": 4}
  assert loaded["a"].dtype == np.float64
  assert loaded["b"][0].dtype == np.int32
  np.testing.assert_array_equal(loaded["b"][0], TREE["b"][0])
  np.testing.assert_array_equal(loaded["a"], TREE["a"])


def test_a_file_of_another_tree_is_refused(tmp_path):
  path = tree_npz.save_tree(tmp_path / "state.npz", TREE, {})
  with pytest.raises(ValueError):
    tree_npz.load_tree(path, {"a": np.arange(4.0), "b": TREE["b"]})
  with pytest.raises(ValueError):
    tree_npz.load_tree(path, {"a": TREE["a"]})
  (tmp_path / "bad.npz").write_bytes(b"not a zip")
  with pytest.raises(ValueError):
    tree_npz.load_tree(tmp_path / "bad.npz", TREE)
