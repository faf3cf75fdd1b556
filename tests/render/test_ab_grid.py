"""The A/B grid page of a targeted run (render/ab_grid.py and its page,
render/ab_grid.html)."""

import json
import os

import numpy as np
import pytest

from decompax.io import run_dir
from decompax.render import ab_grid

P, OPS = 5, ("+", "-")


def _data(two_roles=False):
  a, b = np.meshgrid(np.arange(P), np.arange(P), indexing="ij")
  # Component 1 of "s0" fires where a + b ≡ 0 (mod P) under "+" only;
  # component 3 fires everywhere a little; component 0 is not alive.
  ci1 = np.stack([((a + b) % P == 0) * 1.0, np.zeros((P, P))]).reshape(-1)
  ci3 = np.full(2 * P * P, 0.05)
  ci = np.zeros((2 * P * P, 4))
  ci[:, 1], ci[:, 3] = ci1, ci3
  answer_ci = {"output": {"s0": ci}}
  if two_roles:
    # The hidden role's component 1 fires where a == b under "-" only.
    hidden = np.zeros_like(ci)
    hidden[:, 1] = np.stack([np.zeros((P, P)), (a == b) * 1.0]).reshape(-1)
    # Hidden first, as a jitted result's sorted keys hold them.
    answer_ci = {"hidden": {"s0": hidden}, **answer_ci}
  return ab_grid.snapshot(
    7, OPS, (2, P, P), answer_ci,
    {"s0": np.asarray([False, True, False, True])},
    {"s0": np.asarray([0.5, 0.01, 0.0, 0.25])})


def test_the_snapshot_holds_the_alive_components_by_mean_ci():
  data = _data()
  assert [c["component"] for c in data["components"]] == [1, 3]
  first = data["components"][0]
  assert first["nontarget_density"] == pytest.approx(0.01)
  grid = np.asarray(first["grids"]["output"])
  assert grid.shape == (2, P, P)
  # Row a, column b of the "+" grid is the prompt a + b.
  assert grid[0, 2, 3] == 1.0 and grid[0, 2, 2] == 0.0 and grid[1].sum() == 0
  assert first["mean_ci"] == pytest.approx(P / (2 * P * P))


def test_a_two_role_snapshot_puts_the_output_role_first():
  data = _data(two_roles=True)
  assert data["roles"] == ["output", "hidden"]
  first = data["components"][0]
  # Ranked by the output role's mean CI, as with one role.
  assert [c["component"] for c in data["components"]] == [1, 3]
  assert first["mean_ci"] == pytest.approx(P / (2 * P * P))
  assert first["role_mean_ci"] == pytest.approx(
    {"output": P / (2 * P * P), "hidden": P / (2 * P * P)})
  grid = np.asarray(first["grids"]["hidden"])
  assert grid[1, 2, 2] == 1.0 and grid[1, 2, 3] == 0.0 and grid[0].sum() == 0


def test_write_puts_the_page_and_its_data_side_by_side(tmp_path):
  page = ab_grid.write(str(tmp_path), _data())
  assert os.path.basename(page) == "ab_grid.html"
  text = (tmp_path / "ab_grid_data.js").read_text()
  assert text.startswith("window.AB_GRID = ")
  loaded = json.loads(text[len("window.AB_GRID = "):].rstrip().rstrip(";"))
  assert loaded == json.loads(json.dumps(_data()))
  assert '<script src="ab_grid_data.js">' in (tmp_path / page).read_text()
  # Both are the run's: an --overwrite of the run takes them along.
  assert (tmp_path / run_dir.RECORD_FILE).read_text().split() == [
    "ab_grid_data.js", "ab_grid.html"]


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
  """Return one headless Chromium for the module's page tests."""
  from selenium import webdriver  # noqa: PLC0415
  from selenium.webdriver.chrome.service import Service  # noqa: PLC0415
  for path in (CHROMIUM, CHROMEDRIVER):
    assert os.path.exists(path), (
      f"{path} is missing: apt-get install chromium chromium-driver "
      "(.ci/run installs them)")
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                   "--disable-dev-shm-usage", "--window-size=1200,800"):
    options.add_argument(argument)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(options=options,
                            service=Service(executable_path=CHROMEDRIVER))
  yield driver
  driver.quit()


# Reads the RGB of the centre of cell (a, b) of the `index`-th grid canvas.
_PIXELS = (
  "const c = document.querySelectorAll('#grids canvas')[arguments[0]];"
  "const x = c.getContext('2d');"
  "return arguments[1].map(([a, b]) => Array.from(x.getImageData("
  "b * 12 + 6, a * 12 + 6, 1, 1).data).slice(0, 3));")


def _severe(driver):
  return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_page_shows_a_grid_from_file_urls(tmp_path, browser):
  """Headless Chromium opens the page from file://, logs no console
  error, draws the chosen component's grid per operator, and switches
  component on a click."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  ab_grid.write(str(tmp_path), _data())
  browser.get("file://" + str(tmp_path / "ab_grid.html"))
  assert browser.find_element(By.ID, "title").text == "s0 · component 1"
  canvases = browser.find_elements(By.CSS_SELECTOR, "#grids canvas")
  assert [c.get_attribute("data-op") for c in canvases] == list(OPS)
  # The "+" grid's cell (a=2, b=3) is lit, (2, 2) is white.
  lit, white = browser.execute_script(_PIXELS, 0, [[2, 3], [2, 2]])
  assert white == [255, 255, 255] and lit != [255, 255, 255]
  items = browser.find_elements(By.CSS_SELECTOR, "#list li")
  assert len(items) == 2
  items[1].click()
  assert browser.find_element(By.ID, "title").text == "s0 · component 3"
  assert not _severe(browser)


def test_the_page_shows_each_roles_grid_side_by_side(tmp_path, browser):
  """A dual-role snapshot draws, per operator, one grid per role labelled
  by it (output first), each lit where that role's CI is."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  ab_grid.write(str(tmp_path), _data(two_roles=True))
  browser.get("file://" + str(tmp_path / "ab_grid.html"))
  assert browser.find_element(By.ID, "title").text == "s0 · component 1"
  canvases = browser.find_elements(By.CSS_SELECTOR, "#grids canvas")
  assert [(c.get_attribute("data-op"), c.get_attribute("data-role"))
          for c in canvases] == [
    ("+", "output"), ("+", "hidden"), ("-", "output"), ("-", "hidden")]
  for op in browser.find_elements(By.CSS_SELECTOR, "#grids .op"):
    captions = op.find_elements(By.TAG_NAME, "figcaption")
    assert [c.text for c in captions] == ["output CI", "hidden CI"]
  white = [255, 255, 255]
  cells = [[2, 3], [2, 2]]
  # "+": the output role lights a + b ≡ 0, the hidden role nothing.
  out_plus = browser.execute_script(_PIXELS, 0, cells)
  assert out_plus[0] != white and out_plus[1] == white
  assert browser.execute_script(_PIXELS, 1, cells) == [white, white]
  # "-": the hidden role lights a == b in its own colour, the output none.
  hid_minus = browser.execute_script(_PIXELS, 3, cells)
  assert hid_minus[0] == white and hid_minus[1] != white
  assert browser.execute_script(_PIXELS, 2, cells) == [white, white]
  assert hid_minus[1] != out_plus[0]
  facts = browser.find_element(By.ID, "facts").text
  assert "output 0.100" in facts and "hidden 0.100" in facts
  assert not _severe(browser)


def test_each_grid_has_operand_ticks_and_a_colour_scale(tmp_path, browser):
  """Each grid's b values stand over their columns and its a values beside
  their rows, and each role's grid has a scale from white at CI 0 to the
  role's colour at 1."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  ab_grid.write(str(tmp_path), _data(two_roles=True))
  browser.get("file://" + str(tmp_path / "ab_grid.html"))
  figures = browser.find_elements(By.CSS_SELECTOR, "#grids figure.role")
  assert len(figures) == 4
  for figure in figures:
    canvas = figure.find_element(By.TAG_NAME, "canvas").rect
    for axis, along, start in (("b", "x", canvas["x"]),
                               ("a", "y", canvas["y"])):
      ticks = figure.find_elements(By.CSS_SELECTOR, f".{axis}-ticks span")
      assert [t.text for t in ticks] == [str(i) for i in range(P)]
      size = "width" if along == "x" else "height"
      for i, tick in enumerate(ticks):
        centre = tick.rect[along] + tick.rect[size] / 2
        # The canvas's 1 px border comes before its first cell.
        assert abs(centre - (start + 1 + (i + 0.5) * 12)) <= 1.5
    assert figure.find_element(By.CLASS_NAME, "axis-title").text == "a \\ b"
    scale = figure.find_element(By.CLASS_NAME, "scale")
    assert scale.text.split() == ["CI", "0", "1"]
    role = figure.find_element(By.TAG_NAME, "canvas").get_attribute(
      "data-role")
    colour = {"output": "rgb(230, 90, 20)", "hidden": "rgb(20, 110, 230)"}
    gradient = browser.execute_script(
      "return getComputedStyle(arguments[0]).backgroundImage",
      scale.find_element(By.CLASS_NAME, "bar"))
    assert gradient.startswith("linear-gradient(to right, rgb(255, 255, 255)")
    assert gradient.endswith(f"{colour[role]})")
  assert not _severe(browser)


def test_the_page_asks_for_no_favicon(tmp_path):
  page = ab_grid.write(str(tmp_path), _data())
  head = (tmp_path / page).read_text().split("</head>")[0]
  assert '<link rel="icon" href="data:,">' in head
