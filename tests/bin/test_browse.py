"""bin/browse: the component browser's API on a real server (ephemeral
port) over a harvested induction-toy run: the runs, the component table and
page, a component's A/B grid, predictions with ablations, and refusals of
bad requests; clients that stall, name another host or post from another
origin; and the prompt parsing of token ids and of text through a real
tokenizer."""

import contextlib
import ipaddress
import json
import logging
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from decompax.analysis import explore
from decompax.bin import browse, browse_server
from decompax.io import hf_checkpoint
from decompax.render import ab_grid
from decompax.render import run_report as report


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
def served(harvested):
  """Return the harvested induction run, with an A/B grid snapshot of its
  first site in its report (as a targeted run's slow eval leaves one)."""
  path = harvested("induction", positions=2 * 8 * 32, batch_size=8, top_k=4,
                   ablation_batches=1)
  site = explore.load_run(path).target.sites[0]
  ab_grid.write(f"{path}/{report.REPORT_DIR}", _ab_snapshot(site.name, site.c))
  return browse.serve_run(path)


@contextlib.contextmanager
def _serving(served, **limits):
  """Serve `served` on an ephemeral port; yield the server."""
  httpd = browse.make_server([served], "127.0.0.1", 0, **limits)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  try:
    yield httpd
  finally:
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(served):
  with _serving(served) as httpd:
    yield f"http://127.0.0.1:{httpd.port}"


def _get(url):
  with urllib.request.urlopen(url, timeout=60) as response:
    return response.status, response.read()


def _get_json(url):
  try:
    status, body = _get(url)
  except urllib.error.HTTPError as e:
    status, body = e.code, e.read()
  return status, json.loads(body)


def _post(url, body: bytes, headers=None):
  request = urllib.request.Request(
    url, data=body, headers={"Content-Type": "application/json",
                             **(headers or {})})
  try:
    with urllib.request.urlopen(request, timeout=120) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _port(url: str) -> int:
  return int(url.rsplit(":", 1)[1])


def _stall(port: int, data: bytes) -> socket.socket:
  """Return a connection that sent `data`, and then nothing."""
  sock = socket.create_connection(("127.0.0.1", port), timeout=30)
  sock.sendall(data)
  return sock


def _reply(sock: socket.socket) -> bytes:
  """Return what the server sends on `sock` until it closes it."""
  chunks = []
  while chunk := sock.recv(4096):
    chunks.append(chunk)
  return b"".join(chunks)


HEADERS_CUT = b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: "
BODY_CUT = (b"POST /api/runs/0/predict HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n"
            b'\r\n{"prompt": "1')


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


def test_a_mask_sweep_runs_from_the_ablation_through_the_target(server):
  """Value 1 is the clean model (every mask 1, the delta path on), so the
  curve there is the clean top token's log-probability."""
  prompt = "0 3 5 7 3"
  _, clean = _post(server + "/api/runs/0/predict",
                   json.dumps({"prompt": prompt}).encode())
  top, prob = clean["positions"][-1]["clean"][0]
  status, sweep = _post(server + "/api/runs/0/sweep", json.dumps(
    {"prompt": prompt, "site": "layers.1.mlp.up_proj", "component": 2}
  ).encode())
  assert status == 200 and sweep["token"] == top and sweep["position"] == 4
  assert sweep["values"] == pytest.approx(np.linspace(0, 2, 21).tolist())
  assert len(sweep["log_probs"]) == 21
  assert sweep["log_probs"][10] == pytest.approx(np.log(prob), abs=1e-4)


def test_an_attribution_graph_of_a_prompt(server):
  """The graph's output is the clean top token's logit after the prompt;
  its edges join its nodes, earlier sites and positions to later ones."""
  prompt = "0 3 5 7 3"
  _, clean = _post(server + "/api/runs/0/predict",
                   json.dumps({"prompt": prompt}).encode())
  status, graph = _post(server + "/api/runs/0/graph", json.dumps(
    {"prompt": prompt, "share": 0.8}).encode())
  assert status == 200 and graph["share"] == 0.8
  assert graph["tokens"] == prompt.split() and graph["position"] == 4
  assert graph["nodes"][0]["site"] == "logit"
  assert graph["token_text"] == clean["positions"][-1]["clean"][0][0]
  order = {site: i for i, site in enumerate(graph["sites"] + ["logit"])}
  assert graph["edges"]
  for edge in graph["edges"]:
    source, target = (graph["nodes"][edge[k]] for k in ("source", "target"))
    assert order[source["site"]] < order[target["site"]]
    assert source["position"] <= target["position"] <= 4


def test_an_intervention_mode_masks_every_component(server):
  status, answer = _post(server + "/api/runs/0/intervene", json.dumps(
    {"prompt": "0 3 5 7 3", "mode": "stochastic", "seed": 4}).encode())
  assert status == 200 and answer["mode"] == "stochastic"
  assert len(answer["positions"]) == 5
  assert all(p["kl"] >= -1e-6 for p in answer["positions"])
  again = _post(server + "/api/runs/0/intervene", json.dumps(
    {"prompt": "0 3 5 7 3", "mode": "stochastic", "seed": 4}).encode())[1]
  assert again["positions"] == answer["positions"]


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
] + [
  # The induction toy has 64 rotary positions: a longer prompt would be
  # answered as if the model had seen such contexts.
  (f"/api/runs/0/{endpoint}", json.dumps(
    {"prompt": " ".join(["1"] * 65), "site": "layers.1.mlp.up_proj",
     "component": 0, "mode": "stochastic"}).encode(), 400,
   "prompt has 65 tokens, more than the model's 64 positions; give at "
   "most 64")
  for endpoint in ("predict", "graph", "sweep", "intervene")
] + [
  ("/api/runs/0/predict", b'{"prompt": "1", "ablate": {"nope": [0]}}', 400,
   "no site 'nope'"),
  ("/api/runs/0/predict",
   b'{"prompt": "1", "ablate": {"layers.1.mlp.up_proj": [99]}}', 400,
   "must list components"),
  ("/api/runs/7/predict", b'{"prompt": "1"}', 404, "no run 7"),
  ("/api/runs/0/intervene", b'{"prompt": "1", "mode": "rounded"}', 400,
   "mode must be one of ['ci_masked', 'stochastic', 'adversarial']"),
  ("/api/runs/0/intervene", b'{"prompt": "1"}', 400, "mode must be one of"),
  ("/api/runs/0/intervene", b'{"prompt": "1", "mode": "stochastic", '
   b'"seed": -1}', 400, "seed must be an integer"),
  ("/api/runs/0/sweep", b'{"site": "layers.1.mlp.up_proj", "component": 0}',
   400, "prompt must be a non-empty string"),
  # A JSON true is a Python int, but no component.
  ("/api/runs/0/predict",
   b'{"prompt": "1", "ablate": {"layers.1.mlp.up_proj": [true]}}', 400,
   "must list components"),
  ("/api/runs/0/predict",
   b'{"prompt": "1", "keep": {"layers.1.mlp.up_proj": [false]}}', 400,
   "must list components"),
  # Past 4300 digits Python's int() refuses a number; it is still an id.
  ("/api/runs/0/predict", json.dumps({"prompt": "1" * 5000}).encode(), 400,
   "token id 111111111111… (5000 characters) is outside the vocabulary"),
  ("/api/runs/0/predict", json.dumps({"prompt": "3 -12345678901234"}).encode(),
   400, "is outside the vocabulary"),
  # Nesting is bounded before parsing: no RecursionError, no 500.
  ("/api/runs/0/predict",
   b'{"prompt": "1", "ablate": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
   "nests deeper than 16 levels"),
  ("/api/runs/0/predict", b'{"a": ' * 17 + b"1" + b"}" * 17, 400,
   "nests deeper than 16 levels"),
  # Brackets inside a string do not nest.
  ("/api/runs/0/predict",
   json.dumps({"prompt": "[{" * 100 + '\\"'}).encode(), 400,
   "has no tokenizer"),
] + [
  ("/api/runs/0/sweep", json.dumps(
    {"prompt": "1 2", "site": "layers.1.mlp.up_proj", "component": 0,
     **extra}).encode(), 400, reason)
  for extra, reason in [
    ({"values": [0.5, 2.5]}, "mask value 2.5 is outside [0, 2]"),
    ({"values": [-1]}, "mask value -1 is outside [0, 2]"),
    ({"values": [0.5] * 102}, "values must list 1 to 101 numbers"),
    ({"values": [True]}, "values must list 1 to 101 numbers"),
    ({"values": "0 1"}, "values must list 1 to 101 numbers"),
    ({"site": "nope"}, "no site 'nope'"),
    ({"component": 8}, "component must be an integer in [0, 8)"),
    ({"component": True}, "component must be an integer in [0, 8)"),
    ({"position": 2}, "position must be an integer in [0, 2)"),
    ({"token": 99999}, "token must be an integer in [0, "),
  ]
] + [
  ("/api/runs/0/graph", json.dumps({"prompt": "1 2", **extra}).encode(), 400,
   reason)
  for extra, reason in [
    ({"share": 0}, "share must be a number in (0, 1]"),
    ({"share": 1.5}, "share must be a number in (0, 1]"),
    ({"share": True}, "share must be a number in (0, 1]"),
    ({"position": 2}, "position must be an integer in [0, 2)"),
    ({"token": -1}, "token must be an integer in [0, "),
    ({"prompt": ""}, "prompt must be a non-empty string"),
  ]
])
def test_bad_requests_get_a_status_and_a_one_line_reason(
    server, path, body, status, reason):
  got, answer = _post(server + path, body)
  assert got == status and reason in answer["error"]
  assert "\n" not in answer["error"] and len(answer["error"]) < 300


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


def _get_within(url: str, seconds: float, headers=None):
  request = urllib.request.Request(url, headers=headers or {})
  try:
    with urllib.request.urlopen(request, timeout=seconds) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_stalled_clients_stall_no_one_else(server):
  """An idle socket, headers cut short and a body cut short each hold a
  connection open, while every other request is answered at once."""
  port = _port(server)
  stalled = [_stall(port, data) for data in (b"", HEADERS_CUT, BODY_CUT)]
  try:
    for _ in range(3):
      assert _get_within(server + "/api/runs", 10)[0] == 200
    status, answer = _post(server + "/api/runs/0/predict",
                           b'{"prompt": "0 3 5"}')
    assert status == 200 and answer["tokens"] == ["0", "3", "5"]
  finally:
    for sock in stalled:
      sock.close()


def test_a_prompt_fills_the_model_s_positions_and_pads_no_further(served):
  assert served.run.positions == 64
  # Exactly 64 tokens are answered; 33 pad to 64, not to the 128 bucket
  # that the model has no positions for.
  assert browse.bucket(33, 64) == 64 and browse.bucket(33) == 64
  assert browse.bucket(40, 48) == 48 and browse.bucket(40) == 64
  assert browse.bucket(5, 64) == 16
  assert browse.predictions(served, [1] * 64, {})["tokens"] == ["1"] * 64


def test_input_reads_as_ended_after_a_timeout():
  ours, theirs = socket.socketpair()
  with ours, theirs:
    ours.settimeout(0.05)
    stream = browse_server.TimedOutInput(ours.makefile("rb"))
    with pytest.raises(TimeoutError):
      stream.read(10)
    theirs.sendall(b"late")
    # The socket's own file would raise "cannot read from timed out
    # object" here, which werkzeug logs as a traceback.
    assert stream.read(10_000) == b"" and stream.readline() == b""
    assert stream.readinto(bytearray(4)) == 0


def test_a_stalled_body_is_answered_without_a_traceback(served, caplog):
  """The client stalls past the timeout, gets its 408, then sends the rest
  of its body and resets the connection: werkzeug's drain of the request
  reads nothing more, and logs no error."""
  with caplog.at_level(logging.INFO, logger="werkzeug"):
    with _serving(served, timeout=0.5) as httpd:
      for _ in range(3):
        sock = _stall(httpd.port, BODY_CUT)
        with sock:
          assert sock.recv(4096).startswith(b"HTTP/1.1 408")
          sock.sendall(b"3" * 90)
          sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                          struct.pack("ii", 1, 0))
        time.sleep(0.2)
  assert [r for r in caplog.records if "408" in r.getMessage()]
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("data, answer", [
  (b"", b""), (HEADERS_CUT, b""),
  (BODY_CUT, b"HTTP/1.1 408 REQUEST TIMEOUT"),
])
def test_a_stalled_client_is_disconnected(served, data, answer):
  with _serving(served, timeout=0.5) as httpd:
    sock = _stall(httpd.port, data)
    start = time.monotonic()
    with sock:
      reply = _reply(sock)
    assert time.monotonic() - start < 10
    assert reply.startswith(answer)
    if answer:
      assert b"did not arrive in time" in reply


def test_connections_past_the_cap_are_turned_away(served):
  with _serving(served, max_connections=2) as httpd:
    held = [_stall(httpd.port, b"") for _ in range(2)]
    with _stall(httpd.port, b"") as third:
      assert _reply(third).startswith(b"HTTP/1.1 503")
    for sock in held:
      sock.close()
    # The held connections' threads end as their sockets close.
    url = f"http://127.0.0.1:{httpd.port}/api/runs"
    for _ in range(50):
      with contextlib.suppress(urllib.error.URLError, ConnectionError):
        if _get_within(url, 5)[0] == 200:
          break
      time.sleep(0.1)
    else:
      pytest.fail("the server never answered again")


@pytest.mark.parametrize("host, status", [
  ("127.0.0.1:{port}", 200), ("localhost:{port}", 200),
  ("LOCALHOST", 200), ("[::1]:{port}", 200), ("127.0.0.2:{port}", 200),
  # DNS rebinding: another site's name for this address.
  ("evil.example:{port}", 403), ("evil.example", 403),
  ("127.0.0.1.nip.io:{port}", 403), ("localhost.evil.example", 403),
  ("10.1.2.3:{port}", 403), ("", 403), ("[nonsense:{port}", 403),
  ("evil.example@127.0.0.1:{port}", 403),
])
def test_only_this_servers_names_are_answered(server, host, status):
  got, answer = _get_within(server + "/api/runs", 30, {
    "Host": host.format(port=_port(server))})
  assert got == status
  if status == 403:
    assert "does not answer for Host" in answer["error"]


@pytest.mark.parametrize("origin, status", [
  ("http://evil.example", 403), ("null", 403),
  ("http://localhost:{port}", 403),        # another origin, same machine
  ("https://127.0.0.1:{port}", 403), ("http://127.0.0.1:{port}", 200),
])
def test_writes_from_another_origin_are_refused(server, origin, status):
  got, answer = _post(server + "/api/runs/0/predict", b'{"prompt": "1 2"}',
                      {"Origin": origin.format(port=_port(server))})
  assert got == status
  if status == 403:
    assert "is refused: only this server's own page may post" in (
      answer["error"])


def test_a_server_beyond_loopback_answers_its_addresses_and_names():
  def allowed(header, served="0.0.0.0"):
    return browse_server.host_allowed(header, served, False, {"node7"})
  assert allowed("192.168.1.7:8470") and allowed("[fe80::1]:8470")
  assert allowed("node7:8470") and allowed("localhost:8470")
  assert not allowed("evil.example:8470") and not allowed("node7.evil.example")
  assert allowed("browse.lab:8470", "browse.lab")
  assert not browse_server.host_allowed("192.168.1.7", "127.0.0.1", True)


@pytest.mark.parametrize("address, warned", [
  ("127.0.0.1", None), ("::1", None), ("0.0.0.0", "every interface"),
  ("::", "every interface"), ("192.168.1.7", "which other machines can"),
])
def test_serving_beyond_loopback_is_warned_about(address, warned):
  warning = browse_server.exposure(address, ipaddress.ip_address(address))
  if warned is None:
    assert warning is None
  else:
    assert warned in warning and "--host=127.0.0.1 serves" in warning


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_an_ab_grid_that_is_no_regular_file_is_refused_at_once(
    served, tmp_path, kind):
  """A FIFO would block the reader until some writer came; a device
  (/dev/zero) would be read without end. Both are refused unread."""
  from werkzeug.test import Client  # noqa: PLC0415
  (tmp_path / report.REPORT_DIR).mkdir()
  data = tmp_path / report.REPORT_DIR / ab_grid.DATA
  if kind == "fifo":
    os.mkfifo(data)
  else:
    data.symlink_to(os.devnull)   # read to its end at once, unlike /dev/zero
  client = Client(browse.make_app([served._replace(name=str(tmp_path))]))
  site = served.run.target.sites[0].name
  answers = []
  asking = threading.Thread(target=lambda: answers.append(client.get(
    f"/api/runs/0/ab_grid/{site}/1")), daemon=True)
  asking.start()
  asking.join(30)
  if asking.is_alive():       # free the reader blocked on the FIFO
    os.close(os.open(data, os.O_WRONLY | os.O_NONBLOCK))
    pytest.fail("the A/B grid's reader blocked on a FIFO")
  assert answers[0].status_code == 404
  assert "is not a regular file" in answers[0].get_json()["error"]


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
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(options=options,
                            service=Service(executable_path=CHROMEDRIVER))
  yield driver
  driver.quit()


def _open_component(driver, site, c):
  """Click component `c` of `site` in the table; return its page's box
  once it shows that component."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415
  wait = WebDriverWait(driver, 60)
  row = f'#table tbody tr[data-site="{site}"][data-c="{c}"]'
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, row))
  driver.find_element(By.CSS_SELECTOR, row).click()
  return wait.until(lambda d: d.execute_script(
    "const h = document.querySelector('#component h3');"
    "return h && h.textContent.endsWith(arguments[0]) ?"
    " document.getElementById('component') : null;", f" c{c}"))


# Per chart of the component page: its axis titles and tick labels.
_CHART_TEXT = (
  "return Array.from(document.querySelectorAll('svg.chart')).map(s => ["
  "s.dataset.chart,"
  " Array.from(s.querySelectorAll('.x-label, .y-label'), t => t.textContent),"
  " s.querySelectorAll('.x-tick').length, s.querySelectorAll('.y-tick').length"
  "]);")


def test_a_component_page_reads_in_a_real_browser(server, chromium):
  """Its contexts' positions line up down the rows, its histogram has
  titled, ticked axes, the ablation column names KL, and the page asks
  for no missing favicon."""
  site = next(iter(json.loads(_get(server + "/api/runs")[1])[0]["sites"]))
  chromium.get_log("browser")                     # drop earlier entries
  chromium.get(server + "/")
  c = int(np.argmax([r["density"] for r in json.loads(_get(
    f"{server}/api/runs/0/components")[1]) if r["site"] == site]))
  box = _open_component(chromium, site, c)
  assert chromium.execute_script(
    "return document.getElementById('ablation-header').textContent"
  ) == "ablation KL"
  assert "ablation KL" in box.text
  # Each context is a row of cells; a column's cells share their left edge
  # (inline tokens of unequal widths would not).
  lefts = chromium.execute_script(
    "return Array.from(document.querySelectorAll('tr.context'), r =>"
    " Array.from(r.querySelectorAll('td.token'),"
    " t => Math.round(t.getBoundingClientRect().left)));")
  assert len(lefts) > 1 and all(row == lefts[0] for row in lefts)
  charts = chromium.execute_script(_CHART_TEXT)
  assert charts == [["histogram", ["CI, log scale (first bar: below the "
                                   "floor)", "positions"], 3, 2]]
  missing = [e["message"] for e in chromium.get_log("browser")
             if e["level"] == "SEVERE"]
  assert not missing, missing


@pytest.fixture(scope="module")
def toy_server(toy_served):
  """Serve the TMS run, its busiest linear1 component's neighbour dead."""
  busiest = _busiest(toy_served, "linear1")
  dead = (busiest + 1) % 6
  with _serving(_with_dead(toy_served, "linear1", dead)) as httpd:
    yield f"http://127.0.0.1:{httpd.port}", busiest, dead


def test_a_toy_run_in_a_real_browser(toy_server, chromium):
  """No prompt box (a toy has no next-token predictions) but a note why;
  the ablation column names MSE; contexts shade the features present; the
  charts have titled, ticked axes; a dead component says so, with no
  contexts."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  url, busiest, dead = toy_server
  chromium.get(url + "/")
  box = _open_component(chromium, "linear1", busiest)
  assert not chromium.find_element(By.ID, "prompt-area").is_displayed()
  note = chromium.find_element(By.ID, "no-prompt")
  assert note.is_displayed() and "feature vectors" in note.text
  assert not chromium.find_element(By.ID, "search").is_displayed()
  assert chromium.find_element(By.ID, "ablation-header").text == (
    "ablation MSE")
  assert "ablation MSE" in box.text and "KL" not in box.text
  # The darkest cell of each context is its largest input value.
  darkest = chromium.execute_script(
    "return Array.from(document.querySelectorAll('tr.context'), r => {"
    " const cells = Array.from(r.querySelectorAll('td.token'));"
    " const alpha = cells.map(t =>"
    "  parseFloat(getComputedStyle(t).backgroundColor.split(',')[3] ?? 1));"
    " const values = cells.map(t => Math.abs(Number(t.textContent)));"
    " return [alpha.indexOf(Math.max(...alpha)),"
    "         values.indexOf(Math.max(...values))]; });")
  assert darkest and all(a == b for a, b in darkest)
  charts = {name: (labels, x, y) for name, labels, x, y in
            chromium.execute_script(_CHART_TEXT)}
  assert charts == {
    "histogram": (["CI, log scale (first bar: below the floor)",
                   "positions"], 3, 2),
    "probe": (["feature", "CI"], 5, 2),
    "v": (["input dimension", "V entry"], 5, charts["v"][2]),
    "u": (["output dimension", "U entry"], 2, charts["u"][2])}
  assert charts["v"][2] >= 2 and charts["u"][2] >= 2
  box = _open_component(chromium, "linear1", dead)
  assert "Dead: its CI never exceeded" in box.text
  assert not box.find_elements(By.CSS_SELECTOR, "tr.context")


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


def test_a_mask_sweep_draws_its_curve_in_a_real_browser(server, chromium):
  """A component's sweep on the typed prompt draws the log-probability
  curve with titled, ticked axes, one point per mask value; an
  intervention mode's predictions name the mode in their column."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  from selenium.webdriver.support.ui import Select  # noqa: PLC0415
  from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415
  wait = WebDriverWait(chromium, 120)
  chromium.get_log("browser")                     # drop earlier entries
  chromium.get(server + "/")
  _open_component(chromium, "layers.1.mlp.up_proj", 2)
  chromium.find_element(By.ID, "prompt").send_keys("0 3 5 7 3")
  chromium.find_element(By.ID, "sweep-this").click()
  curve = 'svg[data-chart="sweep"]'
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, curve))
  charts = {name: (labels, x, y) for name, labels, x, y in
            chromium.execute_script(_CHART_TEXT)}
  labels, x_ticks, y_ticks = charts["sweep"]
  assert labels[0] == "mask of layers.1.mlp.up_proj c2"
  assert labels[1].startswith("log p(") and (x_ticks, y_ticks) == (3, 2)
  svg = chromium.find_element(By.CSS_SELECTOR, curve)
  assert len(svg.find_elements(By.TAG_NAME, "circle")) == 21
  assert "21 points" in chromium.find_element(By.ID, "sweep").text
  Select(chromium.find_element(By.ID, "mode")).select_by_value("adversarial")
  chromium.find_element(By.ID, "run-prompt").click()
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".predictions tr"))
  headers = [h.text for h in chromium.find_elements(
    By.CSS_SELECTOR, ".predictions th")]
  assert headers == ["token", "clean", "adversarial (PGD)", "KL"]
  # This site has no A/B grid snapshot: its 404 is the page's answer.
  missing = [e["message"] for e in chromium.get_log("browser")
             if e["level"] == "SEVERE" and "/ab_grid/" not in e["message"]]
  assert not missing, missing


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
  # Each grid's operand values stand beside its rows (a) and over its
  # columns (b), centred on their cells.
  for op in box.find_elements(By.CLASS_NAME, "op"):
    canvas = op.find_element(By.TAG_NAME, "canvas").rect
    for axis, n, along, size in (("a", GRID[1], "y", "height"),
                                 ("b", GRID[2], "x", "width")):
      ticks = op.find_elements(By.CSS_SELECTOR, f".{axis}-ticks span")
      assert [t.text for t in ticks] == [str(i) for i in range(n)]
      cell = canvas[size] / n
      for i, tick in enumerate(ticks):
        centre = tick.rect[along] + tick.rect[size] / 2
        assert abs(centre - (canvas[along] + (i + 0.5) * cell)) <= 2
  # The colour scale: white at CI 0 to the role's colour at 1.
  scale = box.find_element(By.CSS_SELECTOR, '.scale[data-role="output"]')
  assert scale.text.split() == ["output", "CI", "0", "1"]
  gradient = chromium.execute_script(
    "return getComputedStyle(arguments[0]).backgroundImage",
    scale.find_element(By.CLASS_NAME, "bar"))
  assert gradient == ("linear-gradient(to right, rgb(255, 255, 255), "
                      "rgb(230, 90, 20))")
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


@pytest.fixture(scope="module")
def toy_served(harvested_tms):
  """Return the harvested TMS 5-2 run, served."""
  path = harvested_tms
  return browse.serve_run(path)


def _busiest(served, site):
  return int(np.argmax(served.harvest.sites[site]["fired"]))


def _with_dead(served, site, component):
  """Return `served` with `component` of `site` never having fired: its
  top CI below the threshold, as a harvest leaves a dead component."""
  stats = {**served.harvest.sites[site]}
  for field in ("fired", "top_ci"):
    stats[field] = stats[field].copy()
  stats["fired"][component] = 0
  stats["top_ci"][component] = 0.0
  sites = {**served.harvest.sites, site: stats}
  return served._replace(harvest=served.harvest._replace(sites=sites))


def test_a_toy_component_page_shows_its_probe_ci_and_factors(toy_served):
  page = browse.component_page(toy_served, "linear1", 2)
  assert len(page["probe_ci"]) == 5            # one per TMS 5-2 feature
  assert len(page["v"]) == 5 and len(page["u"]) == 2
  run = toy_served.run
  probe = explore.component_ci(run, run.target.feature_probe())["linear1"]
  np.testing.assert_allclose(page["probe_ci"], np.asarray(probe)[:, 2],
                             rtol=1e-6)
  assert all(len(c["tokens"]) == 5 for c in page["contexts"])  # input rows


def test_a_toy_context_shades_the_features_present(toy_served):
  """A toy's context is one input row with one CI: the shading marks its
  nonzero features, the largest darkest, not its first value."""
  page = browse.component_page(toy_served, "linear1",
                               _busiest(toy_served, "linear1"))
  assert page["contexts"]
  for context in page["contexts"]:
    values = np.abs(np.asarray(context["tokens"], float))
    shade = np.asarray(context["shade"])
    assert shade.shape == values.shape
    assert shade[np.argmax(values)] == pytest.approx(1.0)
    assert np.all(shade[values == 0] == 0)
    assert np.all(shade[values > 0.05] > 0)
    assert context["notes"][0].startswith("feature 0: ")


def test_a_token_context_shades_each_token_by_its_ci(served):
  site = served.run.target.sites[0].name
  page = browse.component_page(served, site, _busiest(served, site))
  for context in page["contexts"]:
    assert context["shade"] == context["token_ci"]
    assert len(context["notes"]) == len(context["tokens"])


def test_a_dead_component_shows_no_contexts(toy_served):
  """A component that never fired lists none of its arbitrary top
  positions at CI 0, and says it is dead; a live one shows only contexts
  above the threshold."""
  c = _busiest(toy_served, "linear1")
  alive = browse.component_page(toy_served, "linear1", c)
  assert alive["dead"] is False and alive["contexts"]
  assert all(x["ci"] > alive["threshold"] for x in alive["contexts"])
  dead = browse.component_page(_with_dead(toy_served, "linear1", c),
                               "linear1", c)
  assert dead["dead"] is True and dead["contexts"] == []
  assert dead["threshold"] == toy_served.run.config.ci_alive_threshold


def test_runs_name_their_divergence(served, toy_served):
  from werkzeug.test import Client  # noqa: PLC0415
  runs = Client(browse.make_app([served, toy_served])).get(
    "/api/runs").get_json()
  assert [r["divergence"] for r in runs] == ["KL", "MSE"]
  assert [r["tokens"] for r in runs] == [True, False]


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


def test_a_prompt_of_words_and_numbers_is_text(encode):
  """I60: ids only when every part is one; "the 3" is text, which the
  word tokenizer cannot encode (a 400), and a run without a tokenizer
  refuses it as text (a 400), never reading "the" as an id."""
  status, reason = _refusal("the 3", encode)
  assert status == 400 and "cannot encode" in reason
  assert _refusal("3 the", None) == (400, browse.NO_TOKENIZER)


def test_text_is_encoded_by_the_run_tokenizer(encode):
  assert browse.parse_prompt("the cat sat on the mat", VOCAB, encode) == [
    0, 1, 2, 3, 0, 4]
  # Encoded ids meet the same vocabulary check as typed ones.
  status, reason = _refusal("the <eos>", encode)
  assert status == 400 and "token id 5 is outside" in reason
  status, reason = _refusal("the dog", encode)
  assert status == 400 and "cannot encode" in reason


def test_a_very_long_number_is_an_id_outside_the_vocabulary(encode):
  # Python's int() refuses 5000 digits: the prompt is still ids, not text
  # for the tokenizer (which would make it one unknown word).
  status, reason = _refusal("1 " + "9" * 5000, encode)
  assert status == 400 and "is outside the vocabulary [0, 5)" in reason
  assert len(reason) < 100


def test_too_long_text_is_refused_with_413(encode):
  assert _refusal(" ".join(["cat"] * 300), encode) == (
    413, "prompt has 300 tokens; at most 256")


def test_a_run_without_a_tokenizer_refuses_text(tmp_path):
  assert browse.text_encoder(None) is None
  assert browse.text_encoder(str(tmp_path)) is None   # no tokenizer files
  assert browse.parse_prompt("0 4", VOCAB, None) == [0, 4]
  assert _refusal("the cat", None) == (400, browse.NO_TOKENIZER)


@pytest.fixture(scope="module")
def text_server(harvested):
  """Serve the text run: a tiny Llama with a BPE tokenizer, harvested over
  a tagged token file (part-of-speech labels, neurons and heads)."""
  path = harvested("text_llama", positions=2 * 8 * 16, batch_size=8,
                   top_k=4, ablation_batches=1)
  with _serving(browse.serve_run(path)) as httpd:
    yield f"http://127.0.0.1:{httpd.port}"


def test_a_tagged_run_labels_components_and_baseline_units(text_server):
  """Every component row carries its label; the baselines' tables and
  pages give the same labels, with tagged contexts; an unknown set or unit
  is a 404 naming what there is."""
  run = json.loads(_get(text_server + "/api/runs")[1])[0]
  assert run["classes"][0] == "noun" and run["tokenizer"]
  assert run["baselines"][:4] == [
    "layers.1.mlp.neurons", "layers.1.mlp.gates", "layers.1.mlp.rotated",
    "layers.1.self_attn.heads"]
  matched = "layers.1.mlp.up_proj.density_matched"
  assert matched in run["baselines"]
  rows = json.loads(_get(f"{text_server}/api/runs/0/components")[1])
  alive = [r for r in rows if r["class"] is not None]
  assert alive and all(r["class"] in run["classes"] for r in alive)
  assert all(0 < r["purity"] <= 1 and r["lift"] > 0 for r in alive)
  # A difference of two purities: it may be negative.
  assert all(-1 < r["excess"] < 1 for r in alive)
  units = json.loads(_get(f"{text_server}/api/runs/0/units/{matched}")[1])
  kept = max(units, key=lambda r: r["activity"])
  page = json.loads(_get(
    f"{text_server}/api/runs/0/units/{matched}/{kept['unit']}")[1])
  assert page["excess"] == pytest.approx(kept["excess"])
  heads = json.loads(_get(
    f"{text_server}/api/runs/0/units/layers.1.self_attn.heads")[1])
  assert [r["unit"] for r in heads] == [0, 1]   # the tiny preset's 2 heads
  assert sum(r["activity"] for r in heads) == pytest.approx(1.0)
  neurons = json.loads(_get(
    f"{text_server}/api/runs/0/units/layers.1.mlp.neurons")[1])
  busiest = max(neurons, key=lambda r: r["activity"])
  page = json.loads(_get(f"{text_server}/api/runs/0/units/"
                         f"layers.1.mlp.neurons/{busiest['unit']}")[1])
  assert page["class"] == busiest["class"] and page["top_tags"]
  assert page["contexts"]
  for x in page["contexts"]:
    assert len(x["tokens"]) == len(x["tags"]) == len(x["notes"])
    assert all(note.startswith("tag ") for note in x["notes"])
    assert "activity" in x["notes"][x["focus"]]
    assert "".join(x["tokens"]).strip()   # text, not ids
  for url, reason in (("units/layers.9.mlp.neurons", "no baseline"),
                      ("units/layers.1.mlp.neurons/100000", "has no unit")):
    status, answer = _get_json(f"{text_server}/api/runs/0/{url}")
    assert status == 404 and reason in answer["error"]


def test_a_run_without_tag_statistics_has_no_labels_or_neurons(server):
  run = json.loads(_get(server + "/api/runs")[1])[0]
  assert run["classes"] is None and run["baselines"] == []
  rows = json.loads(_get(f"{server}/api/runs/0/components")[1])
  assert "purity" not in rows[0]
  status, answer = _get_json(f"{server}/api/runs/0/units/layers.1.mlp.neurons")
  assert status == 404 and "no tag statistics" in answer["error"]


def test_a_text_run_in_a_real_browser(text_server, chromium):
  """A typed sentence is answered in text; the component table shows and
  filters by labels; a component's contexts are text with each token's
  tag on hover; the neurons view shows a neuron beside the component."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  from selenium.webdriver.support.ui import (  # noqa: PLC0415
    Select,
    WebDriverWait,
  )
  wait = WebDriverWait(chromium, 120)
  chromium.get(text_server + "/")
  rows = "#table tbody tr"
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, rows))
  total = len(chromium.find_elements(By.CSS_SELECTOR, rows))

  def cells(index):
    return [r.find_elements(By.TAG_NAME, "td")[index].text
            for r in chromium.find_elements(By.CSS_SELECTOR, rows)]

  Select(chromium.find_element(By.ID, "class")).select_by_visible_text(
    "noun")
  assert set(cells(5)) == {"noun"} and len(cells(5)) < total
  purity = chromium.find_element(By.ID, "min-purity")
  purity.clear()
  purity.send_keys("0.3")
  assert all(float(p) >= 0.3 for p in cells(7))
  Select(chromium.find_element(By.ID, "class")).select_by_index(0)
  purity.clear()
  chromium.find_element(By.CSS_SELECTOR, 'th[data-key="purity"]').click()
  shown = [float(p) for p in cells(7) if p != "–"]
  assert shown == sorted(shown, reverse=True)
  site = chromium.find_elements(By.CSS_SELECTOR, rows)[0]
  box = _open_component(chromium, site.get_attribute("data-site"),
                        int(site.get_attribute("data-c")))
  assert "purity" in box.find_element(By.CLASS_NAME, "label").text
  wait.until(lambda d: box.find_elements(By.CSS_SELECTOR, "td.token"))
  token = box.find_elements(By.CSS_SELECTOR, "td.token")[0]
  assert token.get_attribute("title").startswith(
    f"tag {token.get_attribute('data-tag')} (")
  Select(chromium.find_element(By.ID, "view")).select_by_value("units")
  unit_rows = "#units-table tbody tr"
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, unit_rows))
  assert not chromium.find_element(By.ID, "table").is_displayed()
  chromium.find_elements(By.CSS_SELECTOR, unit_rows)[0].click()
  unit = wait.until(lambda d: d.execute_script(
    "const b = document.getElementById('unit');"
    "return b.querySelector('td.token') ? b : null;"))
  assert "layers.1.mlp.neurons u" in unit.text and "purity" in unit.text
  assert unit.find_elements(By.CSS_SELECTOR, "td.token[data-tag]")
  # Side by side: the component's page stays beside the neuron's.
  assert chromium.execute_script(
    "const c = document.getElementById('component').getBoundingClientRect();"
    "const u = document.getElementById('unit').getBoundingClientRect();"
    "return u.left >= c.right && c.width > 0;")
  prompt = chromium.find_element(By.ID, "prompt")
  assert prompt.get_attribute("placeholder").startswith("text")
  prompt.send_keys("the big dog runs")
  chromium.find_element(By.ID, "run-prompt").click()
  table = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                               ".predictions"))[0]
  assert "dog" in table.text and "258" not in table.text


def test_a_link_opens_a_component_and_runs_a_prompt_with_it_chosen(
    text_server, chromium):
  """`#site=..&c=..&prompt=..` (docs/brown.md's screenshot of a text run):
  the component's page with its label, the prompt's predictions with the
  component ablated."""
  from urllib.parse import quote  # noqa: PLC0415

  from selenium.webdriver.common.by import By  # noqa: PLC0415
  from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415
  rows = json.loads(_get(f"{text_server}/api/runs/0/components")[1])
  row = next(r for r in rows if r["class"] is not None)
  site, c = row["site"], row["component"]
  chromium.get("about:blank")  # a fresh load, not a jump within the page
  chromium.get(f"{text_server}/#site={quote(site)}&c={c}&prompt="
               f"{quote('the big dog runs')}")
  wait = WebDriverWait(chromium, 120)
  table = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                               ".predictions"))[0]
  assert "dog" in table.text
  box = chromium.find_element(By.ID, "component")
  assert box.find_element(By.TAG_NAME, "h3").text == f"{site} c{c}"
  assert "purity" in box.find_element(By.CLASS_NAME, "label").text
  assert chromium.find_element(By.ID, "ablated").text == f"{site}:{c}"
  assert chromium.find_element(By.ID, "prompt").get_attribute(
    "value") == "the big dog runs"


def _clustered(served, tmp_path):
  """Return `served` with clusters of linear1 as `bin/cluster` writes them:
  components 0 and 1 one cluster (its effects measured), the rest alone."""
  from decompax.analysis import clustering  # noqa: PLC0415
  found = {"linear1": clustering.SiteClusters(
    ((0, 1), (2,), (3,), (4,)), (9.0, 4.0, 5.0, 6.0), (5,), 10.0, 12.0)}
  effects = {"linear1": [clustering.ClusterEffect(0.5, 0.75, (0.25, 0.5)),
                         None, None, None]}
  manifest = served.harvest.manifest
  record = clustering.clusters_record(found, effects, {
    "seed": 0, "positions": manifest["positions"],
    "threshold": manifest["settings"]["threshold"],
    "decomposition_step": manifest["settings"]["decomposition_step"]})
  return served._replace(clusters=json.loads(json.dumps(record)))


def test_clusters_are_served_per_site(toy_served, tmp_path):
  with _serving(_clustered(toy_served, tmp_path)) as httpd:
    url = f"http://127.0.0.1:{httpd.port}"
    assert _get_json(url + "/api/runs")[1][0]["clusters"] is True
    status, site = _get_json(url + "/api/runs/0/clusters/linear1")
    assert status == 200 and site["clusters"][0]["members"] == [0, 1]
    assert site["clusters"][0]["joint"] == 0.5 and site["never_fired"] == [5]
    status, error = _get_json(url + "/api/runs/0/clusters/nowhere")
    assert status == 404 and "no site 'nowhere'" in error["error"]
  with _serving(toy_served._replace(clusters=None)) as httpd:
    status, error = _get_json(
      f"http://127.0.0.1:{httpd.port}/api/runs/0/clusters/linear1")
    assert status == 404 and "run bin/cluster" in error["error"]


def test_clusters_of_another_harvest_are_refused(harvested_tms, tmp_path):
  import shutil  # noqa: PLC0415
  from decompax.io import harvest_store  # noqa: PLC0415
  path = str(tmp_path / "r")
  shutil.copytree(harvested_tms, path)
  manifest = harvest_store.read_manifest(path)
  harvest_store.write_clusters(path, {
    "positions": manifest["positions"] + 1, "sites": {}, "threshold": 0.0,
    "decomposition_step": 0})
  with pytest.raises(ValueError, match="made from another harvest; rerun "
                     "bin/cluster"):
    browse.serve_run(path)


def test_clusters_show_as_units_in_a_real_browser(toy_served, chromium,
                                                  tmp_path):
  """Choosing a site lists its clusters: members as links, the fires and
  the joint beside the summed effect (MSE on a toy), none for singletons;
  a member opens its component; all sites hide the list."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  from selenium.webdriver.support.ui import (  # noqa: PLC0415
    Select,
    WebDriverWait,
  )
  wait = WebDriverWait(chromium, 60)
  with _serving(_clustered(toy_served, tmp_path)) as httpd:
    chromium.get(f"http://127.0.0.1:{httpd.port}/")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#table tbody tr"))
    box = chromium.find_element(By.ID, "clusters")
    assert not box.is_displayed()
    Select(chromium.find_element(By.ID, "site")).select_by_visible_text(
      "linear1")
    rows = "#clusters-table tbody tr"
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, rows)) == 4)
    assert box.is_displayed()
    assert chromium.find_element(By.ID, "clusters-title").text == (
      "4 clusters of linear1 (1 components never fire)")
    assert chromium.find_element(By.ID, "joint-header").text == "joint MSE"
    cells = [[td.text for td in r.find_elements(By.TAG_NAME, "td")]
             for r in chromium.find_elements(By.CSS_SELECTOR, rows)]
    assert cells[0] == ["0", "0 1", "9", "0.500", "0.750"]
    assert cells[1] == ["1", "2", "4", "–", "–"]
    chromium.find_element(
      By.CSS_SELECTOR, '#clusters-table a.member[data-c="1"]').click()
    wait.until(lambda d: d.execute_script(
      "const h = document.querySelector('#component h3');"
      "return h && h.textContent.endsWith(' c1');"))
    Select(chromium.find_element(By.ID, "site")).select_by_visible_text("all")
    wait.until(lambda d: not box.is_displayed())


def test_an_attribution_graph_draws_in_a_real_browser(server, chromium):
  """The graph of the typed prompt draws one circle per node, the logit's
  column last; clicking a component's node opens its page."""
  from selenium.webdriver.common.by import By  # noqa: PLC0415
  from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415
  wait = WebDriverWait(chromium, 120)
  chromium.get_log("browser")                     # drop earlier entries
  chromium.get(server + "/")
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#table tbody tr"))
  chromium.find_element(By.ID, "prompt").send_keys("0 3 5 7 3")
  chromium.find_element(By.ID, "graph-prompt").click()
  svg = 'svg[data-chart="graph"]'
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, svg))
  _, graph = _post(server + "/api/runs/0/graph",
                   json.dumps({"prompt": "0 3 5 7 3"}).encode())
  drawn = chromium.find_elements(By.CSS_SELECTOR, svg + " circle.node")
  assert len(drawn) == len(graph["nodes"])
  assert len(chromium.find_elements(By.CSS_SELECTOR, svg + " line.edge")) \
    == len(graph["edges"])
  sites = [t.text for t in chromium.find_elements(By.CSS_SELECTOR,
                                                  svg + " text.site")]
  assert sites == graph["sites"] + ["logit"]
  node = chromium.find_elements(By.CSS_SELECTOR,
                                svg + " circle.node[data-site]")[0]
  site, c = node.get_attribute("data-site"), node.get_attribute("data-c")
  node.click()
  wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#component h3")
             .text.endswith(f" c{c}"))
  assert site in chromium.find_element(By.CSS_SELECTOR, "#component h3").text
  missing = [e["message"] for e in chromium.get_log("browser")
             if e["level"] == "SEVERE" and "/ab_grid/" not in e["message"]]
  assert not missing, missing
