"""Token files and their (seed, step) batches."""

import json
import os

import numpy as np
import pytest

from decompax.io import tokens

DOCS = [np.array([5, 6, 7]), np.array([], np.int64), np.array([9, 1, 2, 3, 4]),
        np.arange(10, 40)]
VOCAB = 50
EOS = 0


@pytest.fixture
def token_file(tmp_path):
  path = tmp_path / "train.bin"
  tokens.write_tokens(path, iter(DOCS), VOCAB, EOS, "tiny-tok")
  return str(path)


def _stream():
  return np.concatenate([np.append(d, EOS) for d in DOCS])


def test_round_trip_and_header(token_file):
  opened = tokens.open_tokens(token_file, vocab_size=VOCAB)
  np.testing.assert_array_equal(opened.ids, _stream())
  assert opened.ids.dtype == np.dtype("<u2")
  assert opened.header == tokens.TokenHeader(
    "uint16", VOCAB, len(_stream()), len(DOCS), EOS, "tiny-tok")
  assert os.path.getsize(token_file) == 2 * len(_stream())
  with open(tokens.header_path(token_file)) as f:
    assert json.load(f)["format"] == "decompax.tokens"


def test_large_vocab_uses_uint32(tmp_path):
  path = tmp_path / "big.bin"
  header = tokens.write_tokens(path, [np.array([70_000, 3])], 70_001, 1, "t")
  assert header.dtype == "uint32"
  opened = tokens.open_tokens(path)
  np.testing.assert_array_equal(opened.ids, [70_000, 3, 1])
  assert os.path.getsize(path) == 12


def test_batch_is_a_pure_function_of_seed_and_step(token_file):
  opened = tokens.open_tokens(token_file)
  batch = tokens.read_batch(opened, seed=3, step=7, batch_size=8, seq_len=6)
  assert batch.shape == (8, 6) and batch.dtype == np.int32
  again = tokens.read_batch(tokens.open_tokens(token_file), 3, 7, 8, 6)
  np.testing.assert_array_equal(batch, again)
  assert not np.array_equal(batch, tokens.read_batch(opened, 3, 8, 8, 6))
  assert not np.array_equal(batch, tokens.read_batch(opened, 4, 7, 8, 6))
  # Every row is a contiguous window of the stream at its hashed start.
  starts = tokens.window_starts(3, 7, range(8), len(_stream()), 6)
  for row, start in zip(batch, starts):
    np.testing.assert_array_equal(row, _stream()[start:start + 6])


def test_rows_do_not_depend_on_the_batch_size(token_file):
  # Row r's window depends only on (seed, step, r): resuming or changing
  # the process layout never reshuffles the data.
  opened = tokens.open_tokens(token_file)
  small = tokens.read_batch(opened, 1, 5, 4, 6)
  large = tokens.read_batch(opened, 1, 5, 16, 6)
  np.testing.assert_array_equal(large[:4], small)


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_process_slices_concatenate_to_the_global_batch(token_file,
                                                        process_count):
  opened = tokens.open_tokens(token_file)
  whole = tokens.read_batch(opened, 11, 2, 8, 5)
  parts = [tokens.read_batch(opened, 11, 2, 8, 5, p, process_count)
           for p in range(process_count)]
  assert all(p.shape == (8 // process_count, 5) for p in parts)
  np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_starts_stay_in_bounds_and_spread():
  n, t = 1000, 100
  starts = np.concatenate(
    [tokens.window_starts(0, s, range(64), n, t) for s in range(50)])
  assert starts.min() >= 0 and starts.max() <= n - t
  hist, _ = np.histogram(starts, bins=10, range=(0, n - t + 1))
  assert hist.min() > 0.5 * hist.mean()  # roughly uniform, every bin hit
  full = tokens.window_starts(0, 0, range(4), n, n)
  np.testing.assert_array_equal(full, 0)


@pytest.mark.parametrize("n_windows", [1, 7, 10, 33])
def test_spread_windows_tile_without_overlap_across_the_stream(n_windows):
  n, t = 340, 10  # 34 whole windows
  starts = tokens.spread_window_starts(range(n_windows), n_windows, n, t)
  assert starts[0] == 0 and np.all(starts % t == 0)
  assert np.all(np.diff(starts) >= t)  # no position read twice
  assert starts[-1] + t <= n
  # Evenly spread: the last window reaches the stream's last stretch.
  assert starts[-1] >= n - t - (n // t) * t // n_windows
  # A batch's windows are a slice of the whole pass.
  np.testing.assert_array_equal(
    tokens.spread_window_starts(range(2, n_windows), n_windows, n, t),
    starts[2:])


def test_spread_windows_read_the_whole_stream_when_asked_for_all():
  starts = tokens.spread_window_starts(range(34), 34, 345, 10)
  np.testing.assert_array_equal(starts, np.arange(34) * 10)


def test_spread_windows_refuse_more_windows_than_the_stream_holds():
  _one_line_error(lambda: tokens.spread_window_starts(range(35), 35, 345, 10),
                  "35 windows of 10 tokens do not fit the token file's 34")
  _one_line_error(lambda: tokens.spread_window_starts(range(3, 9), 8, 345, 10),
                  "outside")


def _one_line_error(fn, match):
  with pytest.raises(ValueError, match=match) as error:
    fn()
  assert "\n" not in str(error.value)


def test_missing_files_are_one_line_errors(tmp_path, token_file):
  _one_line_error(lambda: tokens.open_tokens(tmp_path / "nope.bin"),
                  "not found; create it with bin/tokenize")
  os.remove(tokens.header_path(token_file))
  _one_line_error(lambda: tokens.open_tokens(token_file),
                  "token header .* not found")


@pytest.mark.parametrize("edit,match", [
  (lambda h: "{not json", "not valid JSON"),
  (lambda h: json.dumps(h | {"format": "other"}), "is not a decompax.tokens"),
  (lambda h: json.dumps(h | {"version": 9}), "version 9"),
  (lambda h: json.dumps({k: v for k, v in h.items() if k != "eos_id"}),
   r"lacks \['eos_id'\]"),
  (lambda h: json.dumps(h | {"dtype": "uint32"}), "does not match vocab"),
  (lambda h: json.dumps(h | {"vocab_size": "50"}),
   r"\['vocab_size'\] must be non-negative integers"),
  (lambda h: json.dumps(h | {"eos_id": VOCAB}), f"EOS id {VOCAB} is outside"),
  (lambda h: json.dumps(h | {"num_tokens": h["num_tokens"] + 1}),
   "bytes but its header promises"),
])
def test_header_mismatches_are_one_line_errors(token_file, edit, match):
  hpath = tokens.header_path(token_file)
  with open(hpath) as f:
    header = json.load(f)
  with open(hpath, "w") as f:
    f.write(edit(header))
  _one_line_error(lambda: tokens.open_tokens(token_file), match)


def test_truncated_file_and_small_model_vocab_are_refused(token_file):
  _one_line_error(lambda: tokens.open_tokens(token_file, vocab_size=VOCAB - 1),
                  "larger than the model's")
  with open(token_file, "r+b") as f:
    f.truncate(4)
  _one_line_error(lambda: tokens.open_tokens(token_file), "re-run bin/tokenize")


def test_ids_past_the_header_vocab_are_refused(tmp_path):
  # The header promises vocab 10 but the ids run to 999: unchecked, they
  # index past the model's embedding and train on NaN.
  path = tmp_path / "forged.bin"
  tokens.write_tokens(path, [np.arange(1000)], 1000, 9, "t")
  hpath = tokens.header_path(path)
  with open(hpath) as f:
    header = json.load(f)
  with open(hpath, "w") as f:
    json.dump(header | {"vocab_size": 10}, f)
  for vocab_size in (None, 10, 128):
    _one_line_error(lambda: tokens.open_tokens(path, vocab_size),
                    r"holds id 999, outside the vocab \[0, 10\)")


@pytest.mark.parametrize("n", [1, 7, 8, 9, 23])
def test_max_id_reads_every_chunk(tmp_path, monkeypatch, n):
  monkeypatch.setattr(tokens, "_SCAN_IDS", 4)
  path = tmp_path / "ids.bin"
  ids = np.arange(n, dtype="<u4")[::-1].copy()
  ids[-1] = 70_000  # in the last, possibly partial, chunk
  ids.tofile(path)
  assert tokens.max_id(path, np.dtype("<u4")) == 70_000


def test_max_id_reads_a_file_again_only_once_it_changed(tmp_path):
  path = tmp_path / "ids.bin"
  np.arange(10, dtype="<u2").tofile(path)
  reads = tokens._scanned_max_id.cache_info().misses
  assert tokens.max_id(path, np.dtype("<u2")) == 9
  assert tokens.max_id(path, np.dtype("<u2")) == 9
  assert tokens._scanned_max_id.cache_info().misses == reads + 1
  np.arange(12, dtype="<u2").tofile(path)  # rewritten in place, larger
  assert tokens.max_id(path, np.dtype("<u2")) == 11


def test_bad_batch_requests_are_one_line_errors(token_file):
  opened = tokens.open_tokens(token_file)
  n = len(_stream())
  _one_line_error(lambda: tokens.read_batch(opened, 0, 0, 4, n + 1),
                  f"sequence length {n + 1} must be in")
  _one_line_error(lambda: tokens.read_batch(opened, 0, 0, 6, 4, 0, 4),
                  "multiple of the process count 4")
  _one_line_error(lambda: tokens.read_batch(opened, 0, 0, 8, 4, 4, 4),
                  "process index 4")


def test_bad_writes_leave_nothing(tmp_path):
  path = tmp_path / "bad.bin"
  _one_line_error(
    lambda: tokens.write_tokens(path, [np.array([1, 2]), np.array([VOCAB])],
                                VOCAB, EOS, "t"), "outside the vocab")
  _one_line_error(lambda: tokens.write_tokens(path, [], VOCAB, VOCAB, "t"),
                  "EOS id")
  _one_line_error(lambda: tokens.write_tokens(tmp_path / "x.npy", [], VOCAB,
                                              EOS, "t"), "must end in .bin")
  assert os.listdir(tmp_path) == []
