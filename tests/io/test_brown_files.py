"""The Brown corpus on disk, tag streams beside token files, saved trees."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.io import brown_files as brown_io
from decompax.io import tokens, tree_npz

NAMES = ("ca01", "ca02", "cb01")


def _corpus(path, names=NAMES):
  path.mkdir(exist_ok=True)
  for i, name in enumerate(names):
    (path / name).write_text(
      f"\n\n\tThe/at dog{i}/nn ran/vbd ./.\n\n\n\t1/2/cd of/in it/pps ./.\n")
  (path / "README").write_text("not a document\n")
  return str(path)


def test_read_corpus_parses_word_tag_pairs(tmp_path):
  docs = brown_io.read_corpus(_corpus(tmp_path / "c"), NAMES)
  assert list(docs) == list(NAMES)
  assert docs["ca02"] == [[("The", "at"), ("dog1", "nn"), ("ran", "vbd"),
                           (".", ".")],
                          [("1/2", "cd"), ("of", "in"), ("it", "pps"),
                           (".", ".")]]


def test_a_missing_document_is_named(tmp_path):
  corpus = _corpus(tmp_path / "c")
  os.remove(os.path.join(corpus, "ca02"))
  with pytest.raises(ValueError, match=r"lacks .*/ca02 \(2 of 3 documents"):
    brown_io.read_corpus(corpus, NAMES)


def test_an_unexpected_document_is_named(tmp_path):
  corpus = _corpus(tmp_path / "c", (*NAMES, "cz99"))
  with pytest.raises(ValueError, match="holds cz99, not a document"):
    brown_io.read_corpus(corpus, NAMES)


@pytest.mark.parametrize("line,fragment", [
  ("\tThe/at dog ran/vbd", "ca02:3: token 'dog' is not word/tag"),
  ("\tThe/at dog/ ran/vbd", "ca02:3: token 'dog/' is not word/tag"),
  ("\t/at", "ca02:3: token '/at' is not word/tag")])
def test_a_garbled_token_names_file_and_line(tmp_path, line, fragment):
  corpus = _corpus(tmp_path / "c")
  with open(os.path.join(corpus, "ca02"), "w") as f:
    f.write(f"\n\t./.\n{line}\n")
  with pytest.raises(ValueError, match=fragment):
    brown_io.read_corpus(corpus, NAMES)


def test_non_utf8_and_empty_documents_are_refused(tmp_path):
  corpus = _corpus(tmp_path / "c")
  (tmp_path / "c" / "ca01").write_bytes(b"\tThe/at \xff/nn\n")
  with pytest.raises(ValueError, match="ca01 is not UTF-8"):
    brown_io.read_corpus(corpus, NAMES)
  (tmp_path / "c" / "ca01").write_text("\n\n")
  with pytest.raises(ValueError, match="ca01 holds no sentences"):
    brown_io.read_corpus(corpus, NAMES)


def test_install_copies_only_documents_and_keeps_an_old_copy_on_error(
    tmp_path):
  source = _corpus(tmp_path / "src")
  dest = str(tmp_path / "data" / "corpus")
  brown_io.install_corpus(source, dest, NAMES)
  assert sorted(os.listdir(dest)) == sorted(NAMES)
  (tmp_path / "src" / "cb01").write_text("\tbroken\n")
  with pytest.raises(ValueError, match="cb01:1"):
    brown_io.install_corpus(source, dest, NAMES)
  assert sorted(os.listdir(dest)) == sorted(NAMES)
  assert sorted(os.listdir(tmp_path / "data")) == ["corpus"]


def test_split_record_round_trips(tmp_path):
  path = str(tmp_path / "split.json")
  brown_io.write_split(path, ["ca01"], ["ca02"], "rule")
  assert brown_io.read_split(path) == (["ca01"], ["ca02"])
  (tmp_path / "split.json").write_text("{}")
  with pytest.raises(ValueError, match="not a decompax.brown_split"):
    brown_io.read_split(path)


def _tagged(name, ids, tags, starts):
  return tokens.TaggedDocument(name, np.asarray(ids), np.asarray(tags),
                               np.asarray(starts))


DOCS = [_tagged("ca01", [5, 6, 7], [2, 2, 1], [0, 2]),
        _tagged("cb01", [8, 9], [3, 2], [0])]
TAGS = ("<eos>", "<sep>", "nn", "at")


def test_tag_stream_is_parallel_to_the_tokens(tmp_path):
  path = str(tmp_path / "t.bin")
  tokens.write_tagged_tokens(path, DOCS, TAGS, "<eos>", 10, 0, "tok")
  opened = tokens.open_tokens(path)
  stream = tokens.open_tags(opened)
  assert list(opened.ids) == [5, 6, 7, 0, 8, 9, 0]
  assert list(stream.ids) == [2, 2, 1, 0, 3, 2, 0]
  assert stream.tags == TAGS
  assert list(stream.sentence_starts) == [0, 2, 4]
  assert stream.documents == ({"name": "ca01", "start": 0, "num_tokens": 4},
                              {"name": "cb01", "start": 4, "num_tokens": 3})


def test_a_token_file_without_tags_reads_as_before(tmp_path):
  path = str(tmp_path / "t.bin")
  tokens.write_tokens(path, [np.array([1, 2])], 10, 0, "tok")
  opened = tokens.open_tokens(path)
  assert list(opened.ids) == [1, 2, 0]
  assert not tokens.has_tags(path)
  with pytest.raises(ValueError, match="has no tag stream"):
    tokens.open_tags(opened)


def test_tags_that_do_not_match_the_tokens_are_refused(tmp_path):
  path = str(tmp_path / "t.bin")
  tokens.write_tagged_tokens(path, DOCS, TAGS, "<eos>", 10, 0, "tok")
  tokens.write_tokens(path, [np.array([1, 2])], 10, 0, "tok")
  with pytest.raises(ValueError, match="describes 7 tokens, but"):
    tokens.open_tags(tokens.open_tokens(path))


def test_tag_ids_past_the_vocabulary_write_nothing(tmp_path):
  path = str(tmp_path / "t.bin")
  with pytest.raises(ValueError, match="tag ids outside"):
    tokens.write_tagged_tokens(path, [_tagged("x", [1], [9], [0])], TAGS,
                               "<eos>", 10, 0, "tok")
  with pytest.raises(ValueError, match=r"\(1,\) ids but \(2,\) tags"):
    tokens.write_tagged_tokens(path, [_tagged("x", [1], [2, 2], [0])], TAGS,
                               "<eos>", 10, 0, "tok")
  assert os.listdir(tmp_path) == []


def test_tag_header_with_a_tag_past_its_list_is_refused(tmp_path):
  path = str(tmp_path / "t.bin")
  tokens.write_tagged_tokens(path, DOCS, TAGS, "<eos>", 10, 0, "tok")
  header = tmp_path / "t.tags.json"
  record = json.loads(header.read_text())
  header.write_text(json.dumps(record | {"tags": ["<eos>", "<sep>"]}))
  with pytest.raises(ValueError, match="tag ids past its 2 tags"):
    tokens.open_tags(tokens.open_tokens(path))


def test_tree_round_trips_and_refuses_another_shape(tmp_path):
  tree = {"a": jnp.arange(3.0), "b": (jnp.ones((2, 2), jnp.int32),)}
  path = str(tmp_path / "s.npz")
  tree_npz.save_tree(path, tree, {"step": 7})
  got, meta = tree_npz.load_tree(path, jax.eval_shape(lambda: tree))
  assert meta == {"step": 7}
  jax.tree.map(np.testing.assert_array_equal, got, tree)
  other = {"a": jnp.arange(4.0), "b": (jnp.ones((2, 2), jnp.int32),)}
  with pytest.raises(ValueError, match=r"array 0 is float32\[3\]"):
    tree_npz.load_tree(path, other)
