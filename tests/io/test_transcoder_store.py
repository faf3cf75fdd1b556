"""The transcoders' directory: every layer's arrays written to one file and
read back grouped by layer with their metadata, and the results beside
them."""

import json

import numpy as np

from decompax.io import transcoder_store

PARAMS = {3: {"w_enc": np.ones((2, 4), np.float32), "b": np.zeros(4)},
          1: {"w_enc": np.full((2, 4), 2.0, np.float32), "b": np.ones(4)}}


def test_layers_flatten_and_group_back():
  arrays = transcoder_store.layer_arrays(PARAMS)
  assert sorted(arrays) == ["layers.1.b", "layers.1.w_enc", "layers.3.b",
                            "layers.3.w_enc"]
  back = transcoder_store.split_layers(arrays)
  assert list(back) == [1, 3]
  np.testing.assert_array_equal(back[1]["w_enc"], PARAMS[1]["w_enc"])


def test_transcoders_and_results_are_written_and_read(tmp_path):
  out = str(tmp_path)
  transcoder_store.write_transcoders(out, PARAMS, {"k": 4})
  read, meta = transcoder_store.read_transcoders(out)
  assert meta["k"] == 4 and list(read) == [1, 3]
  np.testing.assert_array_equal(read[3]["b"], PARAMS[3]["b"])
  json_path, table_path = transcoder_store.write_results(
    out, {"ce": 1.5}, "| ce |\n")
  assert json.loads(open(json_path).read()) == {"ce": 1.5}
  assert open(table_path).read() == "| ce |\n"
