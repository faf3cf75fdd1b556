"""bin/browse: the component browser's API on a real server (ephemeral
port) over a harvested induction-toy run: the runs, the component table and
page, predictions with ablations, and refusals of bad requests; and the
prompt parsing of token ids and of text through a real tokenizer."""

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from decompax.bin import browse
from decompax.io import hf_checkpoint
from decompax.recipe import explore
from decompax.recipe import harvest as harvest_lib


@pytest.fixture(scope="module")
def server(finished_run):
  path = finished_run("induction")
  run = explore.load_run(path)
  settings = harvest_lib.resolve(run, harvest_lib.Request(
    positions=2 * 8 * 32, batch_size=8, top_k=4, ablation_batches=1))
  out = f"{path}/{harvest_lib.HARVEST_DIR}"
  record = harvest_lib.harvest(run, settings, out, say=lambda _: None)
  harvest_lib.write_manifest(out, path, run, settings, record)
  httpd = browse.make_server([browse.serve_run(path)], "127.0.0.1", 0)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{httpd.server_port}"
  httpd.shutdown()


def _get(url):
  with urllib.request.urlopen(url, timeout=60) as response:
    return response.status, response.read()


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
