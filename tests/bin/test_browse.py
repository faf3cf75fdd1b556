"""bin/browse: the component browser's API on a real server (ephemeral
port) over a harvested induction-toy run: the runs, the component table and
page, a component's A/B grid, predictions with ablations, and refusals of
bad requests; and the prompt parsing of token ids and of text through a
real tokenizer."""

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from decompax.bin import browse
from decompax.io import ab_grid, hf_checkpoint, report
from decompax.recipe import explore
from decompax.recipe import harvest as harvest_lib


# A tiny A/B grid: two operators over a 3 x 4 grid of operands.
OPS, GRID, GRID_STEP = ("+", "-"), (2, 3, 4), 5


def _ab_snapshot(site: str, c: int) -> dict:
  """Return a snapshot in which components 1 and 3 of `site` are alive:
  component 1's CI ramps over the prompts in the grid's order, 3's is 0.5."""
  n = int(np.prod(GRID))
  ci = np.zeros((n, c))
  ci[:, 1], ci[:, 3] = np.arange(n) / n, 0.5
  alive = np.isin(np.arange(c), [1, 3])
  return ab_grid.snapshot(GRID_STEP, OPS, GRID, {"output": {site: ci}},
                          {site: alive}, {site: np.full(c, 0.125)})


@pytest.fixture(scope="module")
def served(finished_run):
  """Return the harvested induction run, with an A/B grid snapshot of its
  first site in its report (as a targeted run's slow eval leaves one)."""
  path = finished_run("induction")
  run = explore.load_run(path)
  settings = harvest_lib.resolve(run, harvest_lib.Request(
    positions=2 * 8 * 32, batch_size=8, top_k=4, ablation_batches=1))
  out = f"{path}/{harvest_lib.HARVEST_DIR}"
  record = harvest_lib.harvest(run, settings, out, say=lambda _: None)
  harvest_lib.write_manifest(out, path, run, settings, record)
  site = run.target.sites[0]
  ab_grid.write(f"{path}/{report.REPORT_DIR}", _ab_snapshot(site.name, site.c))
  return browse.serve_run(path)


@pytest.fixture(scope="module")
def server(served):
  httpd = browse.make_server([served], "127.0.0.1", 0)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{httpd.server_port}"
  httpd.shutdown()


def _get(url):
  with urllib.request.urlopen(url, timeout=60) as response:
    return response.status, response.read()


def _get_json(url):
  try:
    status, body = _get(url)
  except urllib.error.HTTPError as e:
    status, body = e.code, e.read()
  return status, json.loads(body)


def _post(url, body: bytes):
  request = urllib.request.Request(
    url, data=body, headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=120) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_page_runs_and_component_table(server):
  status, page = _get(server + "/")
  assert status == 200 and b"<title>decompax browser</title>" in page
  runs = json.loads(_get(server + "/api/runs")[1])
  assert runs[0]["index"] == 0 and runs[0]["tokens"] is True
  assert runs[0]["tokenizer"] is False          # a toy: ids only
  rows = json.loads(_get(server + "/api/runs/0/components")[1])
  assert len(rows) == sum(runs[0]["sites"].values()) == 7 * 8
  assert all(0 <= r["density"] <= 1 and r["v_norm"] > 0 for r in rows)


def test_component_page(server):
  rows = json.loads(_get(server + "/api/runs/0/components")[1])
  busiest = max(rows, key=lambda r: r["density"])
  page = json.loads(_get(
    f"{server}/api/runs/0/components/{busiest['site']}/"
    f"{busiest['component']}")[1])
  assert page["density"] == busiest["density"]
  assert 0 < len(page["contexts"]) <= 4
  assert all(len(c["tokens"]) == len(c["token_ci"]) for c in page["contexts"])
  assert sum(page["histogram"]["counts"]) == 2 * 8 * 32
  assert all(x["component"] != busiest["component"]
             for x in page["correlated"])


def test_ablating_a_component_changes_the_predictions(server):
  prompt = "0 3 5 7 3"
  status, clean = _post(server + "/api/runs/0/predict",
                        json.dumps({"prompt": prompt}).encode())
  assert status == 200 and clean["tokens"] == prompt.split()
  assert all(p["kl"] == pytest.approx(0.0, abs=1e-6)
             for p in clean["positions"])
  everything = {site: list(range(c)) for site, c in json.loads(
    _get(server + "/api/runs")[1])[0]["sites"].items()}
  status, ablated = _post(server + "/api/runs/0/predict", json.dumps(
    {"prompt": prompt, "ablate": everything}).encode())
  assert status == 200
  assert max(p["kl"] for p in ablated["positions"]) > 0
  assert ablated["positions"][-1]["clean"] == clean["positions"][-1]["clean"]
  probs = [p for _, p in ablated["positions"][-1]["ablated"]]
  assert probs == sorted(probs, reverse=True) and np.sum(probs) <= 1 + 1e-5


def test_a_component_ab_grid(server):
  runs = json.loads(_get(server + "/api/runs")[1])
  assert runs[0]["ab_grid"] is True
  site = next(iter(runs[0]["sites"]))
  status, page = _get_json(f"{server}/api/runs/0/ab_grid/{site}/1")
  assert status == 200
  assert (page["site"], page["component"], page["step"]) == (
    site, 1, GRID_STEP)
  assert page["operators"] == list(OPS) and page["shape"] == list(GRID)
  assert page["roles"] == ["output"]
  # Row a, column b of operator o is prompt (o, a, b) in the grid's order.
  np.testing.assert_allclose(
    page["grids"]["output"],
    np.arange(np.prod(GRID)).reshape(GRID) / np.prod(GRID), atol=1e-4)
  assert page["nontarget_density"] == 0.125


@pytest.mark.parametrize("path, reason", [
  ("/api/runs/0/ab_grid/{site}/0", "not in the A/B grid of step 5"),
  ("/api/runs/0/ab_grid/{other}/1", "not in the A/B grid of step 5"),
  ("/api/runs/0/ab_grid/{site}/99", "has no component 99"),
  ("/api/runs/0/ab_grid/nope/1", "no site 'nope'"),
  ("/api/runs/7/ab_grid/{site}/1", "no run 7"),
])
def test_an_ab_grid_not_there_is_a_404_with_a_reason(server, path, reason):
  sites = list(json.loads(_get(server + "/api/runs")[1])[0]["sites"])
  status, answer = _get_json(
    server + path.format(site=sites[0], other=sites[1]))
  assert status == 404 and reason in answer["error"]
  assert "\n" not in answer["error"]


@pytest.mark.parametrize("content, reason", [
  (None, "this run has no A/B grid"),
  ("window.AB_GRID = {\"step\": 1", "cannot be read"),
  ("window.AB_GRID = {};", "malformed"),
  ("window.AB_GRID = " + " " * 64 + "{};", "is over 64 bytes"),
])
def test_a_run_without_a_readable_ab_grid(
    served, tmp_path, monkeypatch, content, reason):
  from werkzeug.test import Client  # noqa: PLC0415
  monkeypatch.setattr(browse, "MAX_AB_GRID_BYTES", 64)
  if content is not None:
    (tmp_path / report.REPORT_DIR).mkdir()
    (tmp_path / report.REPORT_DIR / ab_grid.DATA).write_text(content)
  client = Client(browse.make_app([served._replace(name=str(tmp_path))]))
  assert client.get("/api/runs").get_json()[0]["ab_grid"] is (
    content is not None)
  site = served.run.target.sites[0].name
  answer = client.get(f"/api/runs/0/ab_grid/{site}/1")
  assert answer.status_code == 404 and reason in answer.get_json()["error"]
  assert "\n" not in answer.get_json()["error"]


def test_the_ab_grid_is_read_once_per_run(served, tmp_path):
  from werkzeug.test import Client  # noqa: PLC0415
  site = served.run.target.sites[0]
  ab_grid.write(str(tmp_path / report.REPORT_DIR),
                _ab_snapshot(site.name, site.c))
  client = Client(browse.make_app([served._replace(name=str(tmp_path))]))
  url = f"/api/runs/0/ab_grid/{site.name}/3"
  assert client.get(url).get_json()["mean_ci"] == 0.5
  (tmp_path / report.REPORT_DIR / ab_grid.DATA).unlink()
  assert client.get(url).status_code == 200


@pytest.mark.parametrize("path, body, status, reason", [
  ("/api/runs/0/predict", b"{not json", 400, "not valid JSON"),
  ("/api/runs/0/predict", b"[1, 2]", 400, "must be a JSON object"),
  ("/api/runs/0/predict", b'{"prompt": "a b"}', 400, "has no tokenizer"),
  ("/api/runs/0/predict", b'{"prompt": "99999"}', 400, "outside the vocab"),
  ("/api/runs/0/predict", json.dumps({"prompt": " ".join(["1"] * 300)}
                                     ).encode(), 413, "at most 256"),
  ("/api/runs/0/predict", b'{"prompt": "1", "ablate": {"nope": [0]}}', 400,
   "no site 'nope'"),
  ("/api/runs/0/predict",
   b'{"prompt": "1", "ablate": {"layers.1.mlp.up_proj": [99]}}', 400,
   "must list components"),
  ("/api/runs/7/predict", b'{"prompt": "1"}', 404, "no run 7"),
])
def test_bad_requests_get_a_status_and_a_one_line_reason(
    server, path, body, status, reason):
  got, answer = _post(server + path, body)
  assert got == status and reason in answer["error"]
  assert "\n" not in answer["error"]


@pytest.mark.parametrize("path", [
  "/api/runs/0/components/..%2F..%2Fetc%2Fpasswd/0",
  "/api/runs/0/ab_grid/..%2F..%2Fetc%2Fpasswd/0",
  "/../../etc/passwd", "/api/runs/0/../../flags.txt", "/api/runs/-1/components",
])
def test_no_request_path_reaches_the_file_system(server, path):
  try:
    status, body = _get(server + path)
  except urllib.error.HTTPError as e:
    status, body = e.code, e.read()
  assert status == 404
  assert b"root:" not in body and b"--target" not in body


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def chromium():
  """Return a headless Chromium under its driver (the Debian packages
  `chromium` and `chromium-driver`, which .ci/run installs)."""
  import os  # noqa: PLC0415
  from selenium import webdriver  # noqa: PLC0415
  from selenium.webdriver.chrome.service import Service  # noqa: PLC0415
  for path in (CHROMIUM, CHROMEDRIVER):
    assert os.path.exists(path), (
      f"{path} is missing: apt-get install chromium chromium-driver "
      "(.ci/run installs them)")
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                   "--disable-dev-shm-usage", "--window-size=1400,900"):
    options.add_argument(argument)
  driver = webdriver.Chrome(options=options,
                            service=Service(executable_path=CHROMEDRIVER))
  yield driver
  driver.quit()


def test_in_a_real_browser(server, chromium, tmp_path):
  """Open the page, sort the table, open a component, type a prompt,
  ablate the component, and see the predictions change."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  from selenium.webdriver.support import expected_conditions  # noqa: PLC0415
  from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415
  wait = WebDriverWait(chromium, 60)
  chromium.get(server + "/")
  rows = "#table tbody tr"
  wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, rows)) == 56)

  def column(index):
    return [float(r.find_elements(By.TAG_NAME, "td")[index].text)
            for r in chromium.find_elements(By.CSS_SELECTOR, rows)]

  header = chromium.find_element(By.CSS_SELECTOR, 'th[data-key="mean_ci"]')
  header.click()
  assert column(3) == sorted(column(3), reverse=True)
  header.click()
  assert column(3) == sorted(column(3))
  chromium.find_elements(By.CSS_SELECTOR, rows)[-1].click()
  wait.until(expected_conditions.presence_of_element_located(
    (By.ID, "ablate-this")))
  title = chromium.find_element(By.CSS_SELECTOR, "#component h3").text
  assert " c" in title

  def predict():
    chromium.find_element(By.ID, "run-prompt").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".predictions tr"))
    table = chromium.find_element(By.CSS_SELECTOR, ".predictions")
    text = table.text
    chromium.execute_script(
      "document.getElementById('predictions').innerHTML = ''")
    return text

  box = chromium.find_element(By.ID, "prompt")
  assert box.get_attribute("placeholder").startswith("token ids")
  box.send_keys("0 3 5 7 3")
  clean = predict()
  chromium.find_element(By.ID, "ablate-this").click()
  assert title.split()[0] in chromium.find_element(By.ID, "ablated").text
  ablated = predict()
  assert ablated != clean
  predict_again = chromium.find_element(By.ID, "run-prompt")
  predict_again.click()
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".predictions tr"))
  shot = tmp_path / "browse.png"
  assert chromium.save_screenshot(str(shot))
  assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_component_page_draws_its_ab_grid(server, chromium):
  """A component in the snapshot gets one canvas per operator, white where
  its CI is 0; one not in the snapshot gets the reason it has none."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415
  wait = WebDriverWait(chromium, 60)
  site = next(iter(json.loads(_get(server + "/api/runs")[1])[0]["sites"]))
  chromium.get(server + "/")

  def open_component(c):
    row = f'#table tbody tr[data-site="{site}"][data-c="{c}"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, row))
    chromium.find_element(By.CSS_SELECTOR, row).click()
    # The box once this component's page and its grid (or reason) are in.
    return wait.until(lambda d: d.execute_script(
      "const h = document.querySelector('#component h3');"
      "const box = document.getElementById('ab-grid');"
      "return h && h.textContent.endsWith(arguments[0]) && box &&"
      " box.textContent.trim() ? box : null;", f" c{c}"))

  def rgb(op, a, b):
    return chromium.execute_script(
      "const canvas = document.querySelectorAll('#ab-grid canvas')"
      "[arguments[0]];"
      "return Array.from(canvas.getContext('2d').getImageData("
      "arguments[2], arguments[1], 1, 1).data).slice(0, 3);", op, a, b)

  box = open_component(1)
  assert f"step {GRID_STEP}" in box.text
  canvases = box.find_elements(By.TAG_NAME, "canvas")
  assert [c.get_attribute("data-op") for c in canvases] == list(OPS)
  # Cell (a, b) of operator o is prompt (o, a, b); its CI grows with both.
  assert rgb(0, 0, 0) == [255, 255, 255]
  assert rgb(1, 2, 3) != [255, 255, 255]
  box = open_component(0)
  assert "not in the A/B grid" in box.text
  assert not box.find_elements(By.TAG_NAME, "canvas")


def test_keep_mode_and_the_prompt_ci_heat_map(server):
  sites = json.loads(_get(server + "/api/runs")[1])[0]["sites"]
  prompt = "0 3 5 7 3"
  everything = {site: list(range(c)) for site, c in sites.items()}
  status, kept = _post(server + "/api/runs/0/predict", json.dumps(
    {"prompt": prompt, "keep": everything}).encode())
  assert status == 200
  # Keeping every component is the clean model.
  assert all(p["kl"] == pytest.approx(0.0, abs=1e-6)
             for p in kept["positions"])
  site = next(iter(sites))
  status, none_kept = _post(server + "/api/runs/0/predict", json.dumps(
    {"prompt": prompt, "keep": {site: []}}).encode())
  assert max(p["kl"] for p in none_kept["positions"]) > 0
  # The heat map: per site, each component alive somewhere on the prompt
  # with its CI at every position.
  assert set(kept["ci"]) == set(sites)
  for site, rows in kept["ci"].items():
    for c, values in rows:
      assert 0 <= c < sites[site] and len(values) == 5
      assert max(values) > 0.1


def test_a_toy_component_page_shows_its_probe_ci_and_factors(finished_run):
  path = finished_run("tms")
  run = explore.load_run(path)
  settings = harvest_lib.resolve(run, harvest_lib.Request(
    positions=512, batch_size=64, top_k=3, ablation_batches=1))
  out = f"{path}/{harvest_lib.HARVEST_DIR}"
  record = harvest_lib.harvest(run, settings, out, say=lambda _: None)
  harvest_lib.write_manifest(out, path, run, settings, record)
  page = browse.component_page(browse.serve_run(path), "linear1", 2)
  assert len(page["probe_ci"]) == 5            # one per TMS 5-2 feature
  assert len(page["v"]) == 5 and len(page["u"]) == 2
  probe = explore.component_ci(run, run.target.feature_probe())["linear1"]
  np.testing.assert_allclose(page["probe_ci"], np.asarray(probe)[:, 2],
                             rtol=1e-6)
  assert all(len(c["tokens"]) == 5 for c in page["contexts"])  # input rows


# A word-level tokenizer with one more entry than the model's vocabulary,
# so that text can encode to an id the model does not have.
WORDS = ["the", "cat", "sat", "on", "mat", "<eos>"]
VOCAB = 5


@pytest.fixture(scope="module")
def encode(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp("model"))
  hf_checkpoint.write_word_tokenizer(model_dir, WORDS, eos_token="<eos>")
  encoder = browse.text_encoder(model_dir)
  assert encoder is not None
  return encoder


def _refusal(prompt, encode):
  with pytest.raises(browse.BadRequest) as refused:
    browse.parse_prompt(prompt, VOCAB, encode)
  assert "\n" not in str(refused.value)
  return refused.value.status, str(refused.value)


def test_integer_prompts_stay_token_ids_even_with_a_tokenizer(encode):
  # "3" is no word of the tokenizer: encoding it would be refused.
  assert browse.parse_prompt(" 3 1\t4 ", VOCAB, encode) == [3, 1, 4]
  assert _refusal("3 9", encode) == (
    400, "token id 9 is outside the vocabulary [0, 5)")


def test_text_is_encoded_by_the_run_tokenizer(encode):
  assert browse.parse_prompt("the cat sat on the mat", VOCAB, encode) == [
    0, 1, 2, 3, 0, 4]
  # Encoded ids meet the same vocabulary check as typed ones.
  status, reason = _refusal("the <eos>", encode)
  assert status == 400 and "token id 5 is outside" in reason
  status, reason = _refusal("the dog", encode)
  assert status == 400 and "cannot encode" in reason


def test_too_long_text_is_refused_with_413(encode):
  assert _refusal(" ".join(["cat"] * 300), encode) == (
    413, "prompt has 300 tokens; at most 256")


def test_a_run_without_a_tokenizer_refuses_text(tmp_path):
  assert browse.text_encoder(None) is None
  assert browse.text_encoder(str(tmp_path)) is None   # no tokenizer files
  assert browse.parse_prompt("0 4", VOCAB, None) == [0, 4]
  assert _refusal("the cat", None) == (400, browse.NO_TOKENIZER)
