"""Subprocesses for tests and benchmarks: a command as N local processes forming one JAX runtime, a server.

Each process gets ``--coordinator-address 127.0.0.1:PORT --num-processes N --process-id I`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=D`` (D simulated CPU devices each), as a user would start
them on N hosts.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.xla_env import with_devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(
  args: list[str],
  processes: int,
  devices: int,
  *,
  port: int | None = None,
  extra: dict | None = None,
  stdout=subprocess.PIPE,
  env: dict | None = None,
  env_per_process: dict | None = None,
) -> list[subprocess.Popen]:
  """Popen of ``python ARGS --coordinator-address ... --process-id I`` for I = 1..N-1, then 0 (text mode, stderr
  piped). extra: {process id: more flags for that process}; env_per_process: {process id: environment changes}."""
  port = port or free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": with_devices(devices), **(env or {})}
  procs = {}
  for i in [*range(1, processes), 0]:
    flags = [f"--coordinator-address=127.0.0.1:{port}", f"--num-processes={processes}", f"--process-id={i}"]
    procs[i] = subprocess.Popen(
      [sys.executable, *args, *flags, *(extra or {}).get(i, [])],
      cwd=REPO,
      env={**env, **(env_per_process or {}).get(i, {})},
      stdout=stdout,
      stderr=subprocess.PIPE,
      text=True,
    )
  return [procs[i] for i in range(processes)]


def wait_all(procs, timeout: float) -> list[tuple[int, str, str]]:
  """(returncode, stdout, stderr) of each process, killing every one still running after timeout."""
  out = []
  try:
    for p in procs:
      o, e = p.communicate(timeout=timeout)
      out.append((p.returncode, o or "", e or ""))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  return out


def start_server(
  flags: list[str], env: dict | None = None, timeout: float = 120, prefix: list[str] = ()
) -> tuple[subprocess.Popen, int]:
  """``[PREFIX] python run_server.py --port=0 FLAGS`` in a subprocess (prefix: e.g. taskset): (process, the
  port it printed it listens on). Raises AssertionError with its stderr if it exits first."""
  proc = subprocess.Popen(
    [*prefix, sys.executable, "run_server.py", "--port=0", *flags],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
  )
  line = proc.stdout.readline()
  while line and "listening on" not in line:
    line = proc.stdout.readline()
  if "listening on" not in line:
    proc.kill()
    raise AssertionError(f"server did not start: {proc.communicate(timeout=timeout)[1][-3000:]}")
  proc.listening_line = line  # (e.g. the metrics address)
  return proc, int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])


def self_signed(folder) -> tuple[bytes, bytes]:
  """(key, certificate) PEM bytes of a new self-signed certificate for localhost and 127.0.0.1 (written to
  folder/key.pem and folder/cert.pem; needs the openssl command). It can serve as its own CA, and as a client
  certificate checked against itself."""
  key, cert = folder / "key.pem", folder / "cert.pem"
  subprocess.run(
    [
      "openssl",
      "req",
      "-x509",
      "-newkey",
      "rsa:2048",
      "-nodes",
      "-keyout",
      str(key),
      "-out",
      str(cert),
      "-days",
      "1",
      "-subj",
      "/CN=localhost",
      "-addext",
      "subjectAltName=DNS:localhost,IP:127.0.0.1",
    ],
    check=True,
    capture_output=True,
  )
  return key.read_bytes(), cert.read_bytes()


_FLOODER = """
import resource, socket, sys, time
port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, opened, end = [], 0, time.monotonic() + seconds
while time.monotonic() < end:
  live = []
  for s in held:
    try:
      if s.recv(1, socket.MSG_DONTWAIT) == b"":
        s.close()
        continue
    except BlockingIOError:
      pass
    except OSError:
      s.close()
      continue
    live.append(s)
  held = live
  while len(held) < count:
    try:  # (at this process's own descriptor limit: hold what it has)
      s = socket.socket()
    except OSError:
      break
    s.setblocking(False)
    try:
      s.connect_ex(("127.0.0.1", port))
    except OSError:
      s.close()
      break
    held.append(s)
    opened += 1
  time.sleep(0.05)
print(opened)
"""


def flood_connections(port: int, count: int, seconds: float) -> subprocess.Popen:
  """A process that holds ``count`` TCP connections to 127.0.0.1:port that never send a byte (a handshake
  never begun), replacing each one the server closes, for ``seconds``; it prints how many it opened in all."""
  return subprocess.Popen(
    [sys.executable, "-c", _FLOODER, str(port), str(count), str(seconds)], stdout=subprocess.PIPE, text=True
  )


def stop(procs) -> list[tuple[int, str]]:
  """Kills every process still running; (returncode, stderr) of each."""
  out = []
  for p in procs:
    if p.poll() is None:
      p.kill()
    _, err = p.communicate()
    out.append((p.returncode, err or ""))
  return out
