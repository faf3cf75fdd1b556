"""The HTTP server of `bin/browse`: its WSGI app served so that no client can
stall it for others, nor reach it from another site.

- Each connection gets its own thread, at most `max_connections` at once
  (one more is answered 503 and closed); a socket that sends or takes
  nothing for `timeout` seconds is closed. The standard library's HTTP
  parser bounds the request line and headers (64 KiB a line, 100 headers);
  the app bounds the body.
- A request must name this server in its Host header: a loopback name or
  address, the served `--host`, or, where it serves beyond loopback, an IP
  address or this machine's own name. A page on a domain that an attacker
  points at 127.0.0.1 (DNS rebinding) names that domain, and gets 403.
- A write (anything but GET and HEAD) whose Origin is not this server gets
  403: another site's page cannot post to `/predict`.
- The listening socket is bound here, before the runs load, so a taken port
  or an address that is not this machine's is one line at once.
"""

import errno
import ipaddress
import json
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

LISTEN_QUEUE = 128
SAFE_METHODS = ("GET", "HEAD")
_BUSY_BODY = json.dumps(
  {"error": "too many open connections; try again"}).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(_BUSY_BODY)) + _BUSY_BODY


def listen(host: str, port: int) -> socket.socket:
  """Return a TCP socket listening on `host:port` (port 0: any free one);
  OSError (or UnicodeError, for a name no resolver takes) where it cannot."""
  # werkzeug adopts the socket as the family it picks from the same rule.
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
  sock = socket.socket(family, socket.SOCK_STREAM)
  try:
    # A restart may bind while the last run's connections linger; two
    # listeners on one port stay impossible.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(LISTEN_QUEUE)
  except BaseException:
    sock.close()
    raise
  return sock


def bind_error(host: str, port: int, error: Exception) -> str:
  """Return why `listen(host, port)` failed, and the fix, on one line."""
  reason = getattr(error, "strerror", None) or str(error)
  if isinstance(error, (socket.gaierror, UnicodeError)):
    return (f"--host={host}: cannot resolve it ({reason}); give an address "
            "of this machine, e.g. 127.0.0.1")
  code = getattr(error, "errno", None)
  if code == errno.EADDRINUSE:
    return (f"--port={port}: {host}:{port} is in use by another program; "
            "stop it or choose another --port (0: any free port)")
  if code == errno.EADDRNOTAVAIL:
    return (f"--host={host} is not an address of this machine ({reason}); "
            "give one of its addresses, e.g. 127.0.0.1")
  if code == errno.EACCES:
    return (f"--port={port}: permission denied ({reason}); ports under 1024 "
            "need privileges: choose another --port")
  return f"--host/--port: cannot serve on {host}:{port} ({reason})"


def bound_address(listening: socket.socket) -> ipaddress.IPv4Address | \
    ipaddress.IPv6Address:
  """Return the address `listening` is bound to."""
  return ipaddress.ip_address(listening.getsockname()[0])


def exposure(host: str, address: ipaddress.IPv4Address |
             ipaddress.IPv6Address) -> str | None:
  """Return a warning where serving on `address` (from `--host=host`) lets
  other machines in, else None."""
  if address.is_loopback:
    return None
  where = ("every interface" if address.is_unspecified
           else f"{address}, which other machines can reach")
  return (f"--host={host} serves on {where}: whoever can connect can "
          "browse these runs and run predictions here; --host=127.0.0.1 "
          "serves this machine alone")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
  try:
    return ipaddress.ip_address(name)
  except ValueError:
    return None


def host_name(header: str) -> str | None:
  """Return the lower-case host of a Host header (no port, no brackets),
  or None where it is not one."""
  if "@" in header:     # user info, which no browser sends in a Host
    return None
  try:
    name = urllib.parse.urlsplit(f"//{header}").hostname
  except ValueError:
    return None
  return name or None


def host_allowed(header: str, served: str, loopback_only: bool,
                 machine_names: Iterable[str] = ()) -> bool:
  """Return whether a request whose Host header is `header` names this
  server, which serves `--host=served` on loopback alone or not."""
  name = host_name(header)
  if name is None:
    return False
  if name == "localhost" or name.endswith(".localhost"):
    return True
  if name == served.lower().strip("[]"):
    return True
  ip = _ip(name)
  if ip is not None:
    # No rebinding attack reaches a page by an IP address, but a loopback
    # server has no business being asked for another.
    return ip.is_loopback or not loopback_only
  return not loopback_only and name in machine_names


def origin_allowed(origin: str | None, host: str | None) -> bool:
  """Return whether a write from `origin` (its Origin header, None where
  the client sent none) comes from this server's own page at `host`."""
  if origin is None:
    return True     # not a browser's cross-site request: those name one
  if host is None:
    return False
  parts = urllib.parse.urlsplit(origin)
  return parts.scheme == "http" and parts.netloc.lower() == host.lower()


def _refuse(start_response: Callable, reason: str) -> list[bytes]:
  body = json.dumps({"error": reason}).encode()
  start_response("403 Forbidden", [("Content-Type", "application/json"),
                                   ("Content-Length", str(len(body)))])
  return [body]


def guarded(app: Callable, served: str, loopback_only: bool) -> Callable:
  """Return `app` refusing (403) requests for another host, and writes
  from another origin."""
  names = set()
  if not loopback_only:
    names = {n.lower() for n in (socket.gethostname(), socket.getfqdn())}

  def guard(environ: dict, start_response: Callable):
    host = environ.get("HTTP_HOST")
    # An HTTP/1.0 client may send no Host; no browser does.
    if host is not None and not host_allowed(host, served, loopback_only,
                                             names):
      return _refuse(start_response, f"this server does not answer for "
                     f"Host {host[:100]!r}; open it by its address, e.g. "
                     f"http://127.0.0.1:{environ.get('SERVER_PORT')}/")
    origin = environ.get("HTTP_ORIGIN")
    if (environ["REQUEST_METHOD"] not in SAFE_METHODS
        and not origin_allowed(origin, host)):
      return _refuse(start_response, f"a write from origin {origin[:100]!r} "
                     "is refused: only this server's own page may post")
    return app(environ, start_response)

  return guard


class TimedOutInput:
  """A connection's input that reads as ended once a read has timed out.

  After answering a body that stalled past the timeout (408), werkzeug
  drains what is left of the request from the socket; the socket's file
  refuses every read after a timeout with an OSError, which werkzeug
  would log as a traceback of the request it has already answered.
  """

  def __init__(self, stream: Any):
    self._stream = stream
    self.timed_out = False

  def __getattr__(self, name: str) -> Any:
    return getattr(self._stream, name)

  def _read(self, method: str, *args: Any) -> Any:
    if self.timed_out:
      return 0 if method == "readinto" else b""
    try:
      return getattr(self._stream, method)(*args)
    except TimeoutError:
      self.timed_out = True
      raise

  def read(self, *args: Any) -> bytes:
    return self._read("read", *args)

  def read1(self, *args: Any) -> bytes:
    return self._read("read1", *args)

  def readline(self, *args: Any) -> bytes:
    return self._read("readline", *args)

  def readinto(self, buffer: Any) -> int:
    return self._read("readinto", buffer)


class Handler(WSGIRequestHandler):
  """werkzeug's request handler, its input ending at a timeout."""

  def setup(self) -> None:
    super().setup()
    self.rfile = TimedOutInput(self.rfile)


class Server(ThreadedWSGIServer):
  """werkzeug's threaded server, with at most `max_connections` threads."""

  def __init__(self, *args, max_connections: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.slots = threading.BoundedSemaphore(max_connections)

  def process_request(self, request, client_address):
    if not self.slots.acquire(blocking=False):
      # Answered without a thread, and never waiting on the client.
      request.setblocking(False)
      try:
        request.send(BUSY)
      except OSError:
        pass
      self.shutdown_request(request)
      return
    try:
      super().process_request(request, client_address)
    except BaseException:
      self.slots.release()
      raise

  def process_request_thread(self, request, client_address):
    try:
      super().process_request_thread(request, client_address)
    finally:
      self.slots.release()


def make_server(app: Callable, host: str, listening: socket.socket,
                timeout: float, max_connections: int) -> Server:
  """Return a server of `app` on the socket `listening` (bound to `host`),
  guarded as the module says; it owns a copy of the socket."""
  loopback_only = bound_address(listening).is_loopback
  handler = type("Handler", (Handler,), {"timeout": timeout})
  return Server(host, listening.getsockname()[1],
                guarded(app, host, loopback_only), handler,
                fd=listening.fileno(), max_connections=max_connections)
