"""Start-up checks of the addresses the server binds, made before the model loads so that a bad ``--host``,
a port in use or an address of another machine fails in a second, naming its flag (the real binds stay the
authority: a port taken in between still fails there)."""

from __future__ import annotations

import socket


def check_bindable(flag: str, host: str, port: int) -> None:
  """ValueError naming ``flag`` unless ``host`` resolves and a TCP socket can bind ``host:port`` now (port 0:
  any free port). ``host`` may be a name, an IPv4 address or an IPv6 one with or without brackets."""
  where = f"{host}:{port}" if "port" in flag else host
  if not host.strip("[]"):
    raise ValueError(f"{flag} {where!r}: an empty host (0.0.0.0 or [::] for every interface)")
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
