"""Start-up checks of the network flags, made before the model loads so that a bad one fails in a second, naming
its flag: the addresses the server binds (a bad ``--host``, a port in use or an address of another machine; the
real binds stay the authority: a port taken in between still fails there), and the range of the timeouts."""

from __future__ import annotations

import math
import socket

# The longest timeout a flag takes, seconds: a day (the client's --timeout-s also takes inf: no deadline).
# gRPC makes a deadline past 2262 (int64 nanoseconds since 1970) an immediate DEADLINE_EXCEEDED: the client's
# --timeout-s 1e10 failed at once; threading.Timer(1e300) raised OverflowError in its thread and never fired;
# jax.distributed's timeouts are 32-bit.
MAX_TIMEOUT_S = 86400


def join_host_port(host: str, port: int) -> str:
  """``HOST:PORT`` as gRPC (and a URL) takes it: an IPv6 address in brackets ("::1" -> "[::1]:PORT"; one already
  bracketed is kept)."""
  if ":" in host and not host.startswith("["):
    host = f"[{host}]"
  return f"{host}:{port}"


def check_timeout(flag: str, seconds: float, allow_inf: bool = False) -> None:
  """ValueError naming ``flag`` unless 0 < seconds <= MAX_TIMEOUT_S (or inf, with ``allow_inf``)."""
  if not (0 < seconds <= MAX_TIMEOUT_S or (allow_inf and seconds == math.inf)):  # NaN fails too
    raise ValueError(
      f"{flag} must be in (0, {MAX_TIMEOUT_S:g}] seconds{' or inf (none)' if allow_inf else ''}, got {seconds}"
    )


def check_bindable(flag: str, host: str, port: int) -> None:
  """ValueError naming ``flag`` unless ``host`` resolves and a TCP socket can bind ``host:port`` now (port 0:
  any free port). ``host`` may be a name, an IPv4 address or an IPv6 one with or without brackets."""
  where = f"{host}:{port}" if "port" in flag else host
  if not host.strip("[]"):
    raise ValueError(f"{flag} {where!r}: an empty host (0.0.0.0 or [::] for every interface)")
  if host.startswith("[") != host.endswith("]") or host.count("[") > 1 or host.count("]") > 1:
    raise ValueError(f"{flag} {where!r}: unbalanced brackets (an IPv6 address is [::1] or ::1)")
  if host.startswith("[") and ":" not in host:
    raise ValueError(f"{flag} {where!r}: brackets are for an IPv6 address (write an IPv4 address or a name bare)")
  try:
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
  except (socket.gaierror, UnicodeError) as e:
    raise ValueError(f"{flag} {where}: not an address of this machine ({e})") from None
  family, kind, proto, _, address = infos[0]
  with socket.socket(family, kind, proto) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: a port in TIME_WAIT is free
    try:
      s.bind(address)
    except OSError as e:
      raise ValueError(f"{flag} {where}: cannot bind ({e.strerror or e})") from None


def same_port(host_a: str, port_a: int, host_b: str, port_b: int) -> bool:
  """Whether two listeners would claim one port: the same nonzero port on the same host or a wildcard one."""
  wildcard = ("", "0.0.0.0", "::", "[::]")
  return port_a == port_b != 0 and (host_a == host_b or host_a in wildcard or host_b in wildcard)
