"""The A/B grid page of a targeted run (io/ab_grid.py, io/ab_grid.html)."""

import json
import os

import numpy as np
import pytest

from decompax.io import ab_grid

P, OPS = 5, ("+", "-")


def _data():
  a, b = np.meshgrid(np.arange(P), np.arange(P), indexing="ij")
  # Component 1 of "s0" fires where a + b ≡ 0 (mod P) under "+" only;
  # component 3 fires everywhere a little; component 0 is not alive.
  ci1 = np.stack([((a + b) % P == 0) * 1.0, np.zeros((P, P))]).reshape(-1)
  ci3 = np.full(2 * P * P, 0.05)
  ci = np.zeros((2 * P * P, 4))
  ci[:, 1], ci[:, 3] = ci1, ci3
  return ab_grid.snapshot(
    7, OPS, (2, P, P), {"output": {"s0": ci}},
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


def test_write_puts_the_page_and_its_data_side_by_side(tmp_path):
  page = ab_grid.write(str(tmp_path), _data())
  assert os.path.basename(page) == "ab_grid.html"
  text = (tmp_path / "ab_grid_data.js").read_text()
  assert text.startswith("window.AB_GRID = ")
  loaded = json.loads(text[len("window.AB_GRID = "):].rstrip().rstrip(";"))
  assert loaded == json.loads(json.dumps(_data()))
  assert '<script src="ab_grid_data.js">' in (tmp_path / page).read_text()


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def test_the_page_shows_a_grid_from_file_urls(tmp_path):
  """Headless Chromium opens the page from file://, logs no console
  error, draws the chosen component's grid per operator, and switches
  component on a click."""
  from selenium import webdriver  # noqa: PLC0415
  from selenium.webdriver.chrome.service import Service  # noqa: PLC0415
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  for path in (CHROMIUM, CHROMEDRIVER):
    assert os.path.exists(path), (
      f"{path} is missing: apt-get install chromium chromium-driver "
      "(.ci/run installs them)")
  ab_grid.write(str(tmp_path), _data())
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                   "--disable-dev-shm-usage", "--window-size=1200,800"):
    options.add_argument(argument)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(options=options,
                            service=Service(executable_path=CHROMEDRIVER))
  try:
    driver.get("file://" + str(tmp_path / "ab_grid.html"))
    assert driver.find_element(By.ID, "title").text == "s0 · component 1"
    canvases = driver.find_elements(By.CSS_SELECTOR, "#grids canvas")
    assert [c.get_attribute("data-op") for c in canvases] == list(OPS)
    # The "+" grid's cell (a=2, b=3) is lit, (2, 2) is white.
    pixel = driver.execute_script(
      "const c = document.querySelectorAll('#grids canvas')[0];"
      "const x = c.getContext('2d');"
      "const at = (a, b) => Array.from(x.getImageData(b * 12 + 6, "
      "a * 12 + 6, 1, 1).data);"
      "return [at(2, 3), at(2, 2)];")
    assert pixel[1][:3] == [255, 255, 255] and pixel[0][:3] != [255, 255, 255]
    items = driver.find_elements(By.CSS_SELECTOR, "#list li")
    assert len(items) == 2
    items[1].click()
    assert driver.find_element(By.ID, "title").text == "s0 · component 3"
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
  finally:
    driver.quit()
