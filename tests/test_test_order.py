"""The suite's order (tests/conftest.py): the long files first, then the
other files and every file's tests in the order the session's seed
draws, each file's tests together."""


def _files(items):
  return [name for name, _ in items]


def test_long_files_lead_and_the_seed_shuffles_the_rest(test_order):
  ordered, long_modules = test_order
  names = ("a.py", "b.py", long_modules[1], "c.py", long_modules[0])
  items = [(name, i) for name in names for i in range(6)]
  module_of = lambda item: item[0]  # noqa: E731
  lead = [long_modules[0]] * 6 + [long_modules[1]] * 6
  written = ordered(items, module_of, None)
  assert _files(written)[:12] == lead
  assert written[12:] == [x for x in items if x[0] not in long_modules]
  drawn = [ordered(items, module_of, seed) for seed in range(8)]
  for order in drawn:
    assert sorted(order) == sorted(items) and _files(order)[:12] == lead
    runs = [n for i, n in enumerate(_files(order))
            if i == 0 or n != _files(order)[i - 1]]
    assert len(runs) == len(names)  # each file's tests run together
  assert len({tuple(order[12:]) for order in drawn}) == len(drawn)
  assert ordered(items, module_of, 3) == drawn[3]
