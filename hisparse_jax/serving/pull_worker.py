"""A decode server's prompt-KV pulls, run in a child process whose death is an ordinary error.

jax's transfer library aborts the process that pulls when the peer answers some malformed byte streams (16 zero
bytes: ``socket-server.cc ... Implement``, SIGABRT), and a decode server pulls from an address a peer names. So
each pull runs in a worker process (CPU jax, its own transfer server) that lands the arrays in host memory and
hands them over as one memfd; the decode server maps it and puts the arrays on its device. A worker that dies
fails the pulls in flight with ``PullWorkerDied`` and is restarted on the next pull; the server keeps serving.

    decode server ──(address, uuid, shapes)──▶ worker: TransferEndpoint.pull -> CPU arrays -> one memfd
                  ◀──────(header, memfd)────────┘
    mmap -> numpy views -> jax.device_put(device)

Frames on the Unix socket between them: 4-byte little-endian length + JSON; a reply carries the memfd with
SCM_RIGHTS. Cost: one host copy in the worker (into the memfd's new pages) and a ``device_put`` of the mapped
pages (none on CPU, where it takes them as they are; host to device on a GPU); benchmarks/disaggregation.py
measures it against an in-process pull.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: each array starts at a multiple of this in the memfd
MAX_FRAME_BYTES = 1 << 20
START_TIMEOUT_S = 120.0  # the worker imports jax and starts its transfer server within this


class PullWorkerDied(RuntimeError):
  """The worker process ended while a pull was in flight (the peer's bytes crashed jax's transfer library)."""


def _send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
  data = json.dumps(message).encode()
  frame = struct.pack("<I", len(data)) + data
  if fds:
    socket.send_fds(sock, [frame], list(fds))
  else:
    sock.sendall(frame)


def _recv_exactly(sock: socket.socket, n: int, fds: list) -> bytes | None:
  chunks, size = [], 0
  while size < n:
    data, got, _, _ = socket.recv_fds(sock, n - size, 4)
    fds.extend(got)
    if not data:
      return None
    chunks.append(data)
    size += len(data)
  return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[dict, list[int]] | None:
  """(message, fds), or None at the end of the stream."""
  fds: list[int] = []
  head = _recv_exactly(sock, 4, fds)
  if head is None:
    return None
  (n,) = struct.unpack("<I", head)
  if n > MAX_FRAME_BYTES:
    raise ValueError(f"pull worker frame of {n} bytes")
  body = _recv_exactly(sock, n, fds)
  if body is None:
    return None
  return json.loads(body), fds


def _offsets(nbytes: list[int]) -> tuple[list[int], int]:
  """Each array's offset in the memfd (ALIGN-aligned) and the memfd's size."""
  offsets, end = [], 0
  for n in nbytes:
    offsets.append(end)
    end += -(-n // ALIGN) * ALIGN
  return offsets, max(end, 1)


class PullWorker:
  """The decode server's side: ``pull`` has ``TransferEndpoint.pull``'s contract, run in the worker process."""

  def __init__(self, host: str = "127.0.0.1", port: int = 0):
    """host, port: the worker's transfer server (``--transfer-host`` / ``--transfer-port``). Starts the worker
    (ValueError naming the flags if its transfer server cannot start)."""
    self.host, self.port = host, port
    self._lock = threading.Lock()  # the pending pulls and the current worker
    self._start_lock = threading.Lock()  # one (re)start at a time
    self._proc: subprocess.Popen | None = None
    self._sock: socket.socket | None = None
    self._pending: dict[int, tuple[concurrent.futures.Future, socket.socket]] = {}  # id -> (reply, worker link)
    self._next_id = 0
    self._closed = False
    self.restarts = 0
    self.address = self._start()

  def _ensure(self) -> None:
    """A worker runs (one that died is replaced: ValueError if the new one cannot start)."""
    with self._start_lock:
      if self._sock is None and not self._closed:
        self.restarts += 1
        self.address = self._start()

  def _start(self) -> str:
    """Starts a worker; its transfer server's address."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"  # host memory only: no device memory, no second GPU client
    proc = subprocess.Popen(
      [sys.executable, "-m", "hisparse_jax.serving.pull_worker", str(theirs.fileno()), self.host, str(self.port)],
      pass_fds=(theirs.fileno(),),
      env=env,
      stdin=subprocess.DEVNULL,
    )
    theirs.close()
    ours.settimeout(START_TIMEOUT_S)
    try:
      ready = _recv(ours)
    except OSError:
      ready = None
    if ready is None or "address" not in ready[0]:
      proc.kill()
      ours.close()
      why = ready[0].get("error") if ready else f"it exited with status {proc.wait()}"
      raise ValueError(
        f"--transfer-host/--transfer-port {self.host}:{self.port}: the KV pull worker did not start ({why})"
      )
    ours.settimeout(None)
    with self._lock:
      self._proc, self._sock = proc, ours
    threading.Thread(target=self._read, args=(proc, ours), name="pull-worker-reader", daemon=True).start()
    return ready[0]["address"]

  def _read(self, proc, sock) -> None:
    """Dispatches the worker's replies; at its end, fails what is pending on it."""
    try:
      while (got := _recv(sock)) is not None:
        message, fds = got
        with self._lock:
          future, _ = self._pending.pop(message["id"], (None, None))
        if future is None:
          for fd in fds:
            os.close(fd)
        elif "error" in message:
          future.set_exception(RuntimeError(message["error"]))
        else:
          future.set_result((message, fds))
    except (OSError, ValueError) as e:
      log.warning("KV pull worker: %s", e)
    sock.close()
    status = proc.wait()
    with self._lock:
      if self._sock is sock:
        self._sock = None
      failed = [f for f, link in self._pending.values() if link is sock]
      self._pending = {k: v for k, v in self._pending.items() if v[1] is not sock}
    if failed or not self._closed:
      log.warning("KV pull worker exited with status %s; %d pull(s) failed", status, len(failed))
    for f in failed:
      f.set_exception(
        PullWorkerDied(
          f"the KV pull worker process died (exit status {status}) during the pull: the peer's transfer data crashed it"
        )
      )
    try:  # replaced now, not on the next pull (a start takes seconds)
      self._ensure()
    except ValueError as e:
      log.warning("KV pull worker: %s (retried at the next pull)", e)

  def pull(self, address: str, uuid: int, specs, timeout_s: float | None = None) -> list:
    """The arrays offered under uuid at address, on each spec's sharding (blocking).

    Raises:
      TimeoutError: no data within timeout_s.
      PullWorkerDied: the worker died during the pull (it is restarted for the next one).
      RuntimeError: the transfer failed, or the worker is closed.
    """
    import jax
    import numpy as np

    request = {
      "address": address,
      "uuid": uuid,
      "timeout_s": timeout_s,
      "specs": [[list(s.shape), np.dtype(s.dtype).name] for s in specs],
    }
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._ensure()
    with self._lock:
      if self._closed or self._sock is None:
        raise RuntimeError("the KV pull worker is closed" if self._closed else "the KV pull worker died")
      request["id"] = self._next_id
      self._next_id += 1
      sock = self._sock
      self._pending[request["id"]] = (future, sock)
    try:
      _send(sock, request)
    except OSError:
      pass  # the reader fails the future as the worker's end is seen
    try:  # (the worker's own timer bounds the pull; this bounds a wedged worker)
      message, fds = future.result(None if timeout_s is None else timeout_s + START_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
      with self._lock:
        self._pending.pop(request["id"], None)
      raise TimeoutError(f"the KV pull worker did not answer within {timeout_s + START_TIMEOUT_S:g} s") from None
    if message.get("timeout"):
      raise TimeoutError(message["timeout"])
    try:
      size = os.fstat(fds[0]).st_size
      offsets, need = _offsets(message["nbytes"])
      if len(fds) != 1 or size < need:
        raise RuntimeError(f"the KV pull worker sent {len(fds)} descriptors of {size} bytes; expected one of {need}")
      # Private and writable (copy on write): a CPU device_put takes the pages without a copy, and nothing the
      # array's users write reaches the memfd. The mapping lives as long as the arrays do.
      buffer = mmap.mmap(fds[0], size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
      for fd in fds:
        os.close(fd)
    return [
      jax.device_put(
        np.frombuffer(buffer, np.dtype(spec.dtype), n // np.dtype(spec.dtype).itemsize, offset).reshape(spec.shape),
        spec.sharding,
      )
      for spec, offset, n in zip(specs, offsets, message["nbytes"])
    ]

  def close(self) -> None:
    """Ends the worker (pulls in flight fail)."""
    with self._lock:
      self._closed = True
      proc, sock = self._proc, self._sock
    if sock is not None:
      sock.close()
    if proc is not None:
      proc.kill()
      proc.wait()


def _serve(fd: int, host: str, port: int) -> None:
  """The worker: pulls on request (one thread each), answers each with one memfd of the arrays."""
  import jax
  import numpy as np

  from hisparse_jax.serving.disaggregation import TransferEndpoint

  sock = socket.socket(fileno=fd)
  try:
    endpoint = TransferEndpoint(host, port)
  except ValueError as e:
    _send(sock, {"error": str(e)})
    return
  _send(sock, {"address": endpoint.address})
  device = jax.sharding.make_single_device_sharding(jax.devices()[0])
  send_lock = threading.Lock()

  def pull(request: dict) -> None:
    reply, fds = {"id": request["id"]}, ()
    try:
      specs = [
        jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype), sharding=device) for shape, dtype in request["specs"]
      ]
      arrays = [np.asarray(x) for x in endpoint.pull(request["address"], request["uuid"], specs, request["timeout_s"])]
      nbytes = [a.nbytes for a in arrays]
      offsets, size = _offsets(nbytes)
      memfd = os.memfd_create("kv-pull", os.MFD_CLOEXEC)
      os.ftruncate(memfd, size)
      with mmap.mmap(memfd, size) as buffer:
        for a, offset in zip(arrays, offsets):
          np.frombuffer(buffer, a.dtype, a.size, offset)[:] = a.reshape(-1)
      reply["nbytes"], fds = nbytes, (memfd,)
    except TimeoutError as e:
      reply["timeout"] = str(e)
    except Exception as e:  # noqa: BLE001 - the transfer failed: the caller's error
      reply["error"] = (str(e) or type(e).__name__).splitlines()[0]
    try:
      with send_lock:
        _send(sock, reply, fds)
    finally:
      for f in fds:
        os.close(f)

  threads = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="pull")
  while (got := _recv(sock)) is not None:
    threads.submit(pull, got[0])
  endpoint.close()
  os._exit(0)  # (the parent is gone: no need to wait for pulls it will not read)


if __name__ == "__main__":
  if len(sys.argv) != 4 or not sys.argv[1].isdigit() or not sys.argv[3].isdigit():
    sys.exit(
      "hisparse_jax.serving.pull_worker is a decode server's own worker process (PullWorker starts it with "
      "a socket descriptor, a host and a port), not a command"
    )
  logging.basicConfig(level=logging.WARNING)
  _serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
