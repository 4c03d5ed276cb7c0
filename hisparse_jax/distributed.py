"""Several processes, one device mesh: ``jax.distributed`` start-up and the lock-step of the processes' engines.

N processes (one per host; several on one machine for tests) form one JAX runtime: ``initialize`` joins
them through ``jax.distributed.initialize`` (process 0 hosts JAX's coordination service; CPU collectives
between processes go through gloo), ``jax.devices()`` then lists every process's devices, and the serving
mesh (hisparse_jax/sharding.py) covers all of them. A JAX program over such a mesh is SPMD across
processes: every process must run the same jitted calls, with the same shapes, in the same order.

So every process runs the same engine (same flags, model and tokenizer) on the same schedule (SGLang's
multi-node design: each rank runs the scheduler on the requests rank 0 broadcasts). Process 0, the
leader, takes the requests (gRPC or the batch file); before each engine step it broadcasts what changed
since the previous one -- the requests submitted (with the seeds it drew) and aborted, in order -- and the
followers apply the same changes and take the same step (``Engine.follow``). Scheduling is a function of
those inputs alone (arrival order, sizes, tokens; no clocks), and sampled tokens come back replicated to
every process, so all engines admit, preempt, prefill, decode and finish identically. Each step message
carries the leader's step counters, which a follower checks against its own before stepping: a
divergence is an error naming both, never a silent hang.

Messages go through ``jax.experimental.multihost_utils.broadcast_one_to_all`` (a psum over the devices
of all processes): one ``FRAME``-byte broadcast when the message fits, plus one of the rest (padded to a
power of two, so few shapes compile) when it does not. While idle the leader sends a heartbeat message
at most every ``IDLE_HEARTBEAT_S`` seconds, so no follower sits in one collective for long. Before a message
every process waits for its own calls in flight (``Engine._settle``: one process's CPU collectives must not
overlap), and ``initialize`` turns programs' source locations off (they would give the same program another
launch id on each process).

Faults. A process that dies takes the others down with a message, never a hang: a collective with a
dead peer fails (gloo: "Connection closed by peer") and the survivor prints which process was lost and
exits with status 1 (``fatal``: no recovery is possible, and a normal exit would wait in
jax.distributed's shutdown barrier for the dead process); a survivor that is not in a collective is
stopped by JAX's coordination service once the dead process misses its heartbeats
(``--distributed-heartbeat-timeout-s``). Start-up: a follower whose coordinator does not answer, or a
leader whose followers do not all join, within ``--distributed-init-timeout-s`` exits with status 1 and a
message naming the flag (jax.distributed itself would abort the process with a misleading message).
Processes started with different engine flags find out at start-up (``check_same``): every process
stops with a message naming the flag and both values.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import socket
import sys
import threading
import time

import numpy as np

from hisparse_jax.serving.addresses import MAX_TIMEOUT_S

# First broadcast of a message (bytes): an 8-byte length and the start of the payload.
FRAME = 4096
# The leader's longest silence while idle (seconds).
IDLE_HEARTBEAT_S = 1.0
# Bytes of the engine settings every process compares at start-up.
SETTINGS_BYTES = 16384
MAX_PROCESSES = 65536
# Seconds process 0 waits, on a start-up error every process shares, before it exits (after the others).
EXIT_GRACE_S = 1.0


_WHO = ["process 0 of 1"]  # this process, for messages (set by initialize; JAX may not answer while it starts)
_ARGS: list = [None]  # the DistributedArgs initialize joined with


def flags() -> dict:
  """The distributed flags every process must share (``check_same``), from ``initialize``."""
  a = _ARGS[0]
  return (
    {}
    if a is None
    else dict(num_processes=a.num_processes, distributed_heartbeat_timeout_s=a.distributed_heartbeat_timeout_s)
  )


class DistributedError(RuntimeError):
  """The processes cannot work together (start-up) or fell out of step."""


@dataclasses.dataclass
class DistributedArgs:
  """Flags of a multi-process deployment: one field per flag ('_' -> '-': ``process_id`` is ``--process-id``),
  each field's ``metadata["help"]`` its only description (the flag's --help)."""

  coordinator_address: str | None = dataclasses.field(
    default=None,
    metadata={
      "help": "HOST:PORT of process 0 (it hosts the JAX coordination service there); needed with --num-processes > 1."
    },
  )
  num_processes: int = dataclasses.field(
    default=1,
    metadata={"help": "Processes forming one device mesh (each runs this command with its own --process-id)."},
  )
  process_id: int = dataclasses.field(
    default=0,
    metadata={"help": "This process's index in [0, --num-processes); 0 takes the requests, the others follow it."},
  )
  distributed_init_timeout_s: int = dataclasses.field(
    default=120, metadata={"help": "Seconds start-up waits for the coordinator / for every process to join."}
  )
  distributed_heartbeat_timeout_s: int = dataclasses.field(
    default=30, metadata={"help": "Seconds a silent (dead) process is given before the others stop."}
  )

  @classmethod
  def define_flags(cls, flags_module=None) -> None:
    from absl import flags as absl_flags

    fl = flags_module or absl_flags
    for f in dataclasses.fields(cls):
      name, help_ = f.name.replace("_", "-"), f.metadata["help"]
      if f.type in (int, "int"):
        fl.DEFINE_integer(name, f.default, help_)
      else:
        fl.DEFINE_string(name, f.default, help_)

  @classmethod
  def from_flags(cls, flag_values=None) -> "DistributedArgs":
    from absl import flags as absl_flags

    fv = flag_values or absl_flags.FLAGS
    return cls(**{f.name: fv[f.name.replace("_", "-")].value for f in dataclasses.fields(cls)})

  def validate(self) -> None:
    """StartupError naming the flag: sizes out of range, a missing or malformed --coordinator-address."""
    from hisparse_jax.engine.args import StartupError

    if not 1 <= self.num_processes <= MAX_PROCESSES:
      raise StartupError(f"--num-processes must be in [1, {MAX_PROCESSES}], got {self.num_processes}")
    if not 0 <= self.process_id < self.num_processes:
      raise StartupError(
        f"--process-id {self.process_id}: expected 0..{self.num_processes - 1} (--num-processes {self.num_processes})"
      )
    for flag, v in (
      ("--distributed-init-timeout-s", self.distributed_init_timeout_s),
      ("--distributed-heartbeat-timeout-s", self.distributed_heartbeat_timeout_s),
    ):
      if not 1 <= v <= MAX_TIMEOUT_S:
        raise StartupError(f"{flag} must be in [1, {MAX_TIMEOUT_S}] seconds, got {v}")
    if self.coordinator_address:
      self.host_port()
    if self.num_processes > 1 and not self.coordinator_address:
      raise StartupError(
        f"--num-processes {self.num_processes} needs --coordinator-address HOST:PORT (process 0's "
        "address; the same on every process)"
      )

  def host_port(self) -> tuple[str, int]:
    """(host, port) of --coordinator-address (an IPv6 address in brackets: [::1]:1234)."""
    from hisparse_jax.engine.args import StartupError

    address = self.coordinator_address or ""
    host, sep, port = address.rpartition(":")
    bad = f"--coordinator-address {address!r}: expected HOST:PORT (an IPv6 address as [ADDRESS]:PORT)"
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
      raise StartupError(bad)
    if host.startswith("["):
      if not host.endswith("]") or ":" not in host:
        raise StartupError(bad)
      host = host[1:-1]
    elif ":" in host or not host.isascii():
      raise StartupError(bad)
    if not host or any(c.isspace() or not c.isprintable() or c in "/@?#[]" for c in host):
      raise StartupError(f"{bad}; {host!r} is not a host name or address")
    return host, int(port)


def initialize(args: DistributedArgs) -> None:
  """Joins this process to the others (nothing to do for one process). Call before anything touches a JAX
  device. Exits with status 1 and a message naming the flag when the others cannot be reached in time.

  Raises:
    StartupError: bad flags (``DistributedArgs.validate``), process 0's coordinator port is taken, or the
      coordination service cannot start.
  """
  from hisparse_jax.engine.args import StartupError

  args.validate()
  if args.num_processes == 1:
    return
  import jax

  _WHO[0] = f"process {args.process_id} of {args.num_processes}"
  _ARGS[0] = args
  host, port = args.host_port()
  timeout = args.distributed_init_timeout_s
  if args.process_id == 0:
    _check_port_free(args.coordinator_address, port)
  else:
    _wait_for_coordinator(host, port, timeout, args.coordinator_address)
  _native_stdout_to_stderr()
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Programs' source locations off: XLA derives a program's launch id, which its collectives carry, from a
  # fingerprint of the program, locations included, and a program traced from different call sites (process
  # 0 sends a lock-step message from Lockstep.publish, the others receive it in Lockstep.receive) would get
  # another id on each process. jax/jaxlib 0.12.1's CPU collectives then waited for each other forever at the
  # first message (measured; 0.12.0 matched them regardless). Op names stay in the programs; only the Python
  # call stacks leave (profiles of a multi-process run show no source lines).
  jax.config.update("jax_traceback_in_locations_limit", 0)
  # JAX's preemption service catches SIGTERM in every process and only records it: a process would then
  # ignore SIGTERM. Off: the entry points handle SIGTERM (process 0 as one process does; a follower stops).
  jax.config.update("jax_enable_preemption_service", False)
  # jax.distributed aborts the whole process (SIGABRT, a misleading "another task died") when the others do
  # not join in time: a watchdog gives the real reason first, and exits.
  who = (
    "not every process joined (start each of the other processes with the same --coordinator-address "
    "and --num-processes and its own --process-id; one that stopped on a flag error before joining says "
    "why in its own output)"
    if args.process_id == 0
    else "the coordinator answered but start-up did not complete (is another process running with the same "
    "--process-id, or a different --num-processes?)"
  )
  done = threading.Event()

  def watchdog():
    if not done.wait(timeout):
      fatal(
        f"--num-processes {args.num_processes}, --coordinator-address {args.coordinator_address}: {who} "
        f"within --distributed-init-timeout-s {timeout}"
      )

  threading.Thread(target=watchdog, name="distributed-init-watchdog", daemon=True).start()
  try:
    jax.distributed.initialize(
      args.coordinator_address,
      num_processes=args.num_processes,
      process_id=args.process_id,
      initialization_timeout=timeout + 30,
      heartbeat_timeout_seconds=args.distributed_heartbeat_timeout_s,
      shutdown_timeout_seconds=args.distributed_heartbeat_timeout_s,
    )
  except Exception as e:  # noqa: BLE001 - e.g. "Failed to start RPC server"
    done.set()
    raise StartupError(
      f"--coordinator-address {args.coordinator_address}: jax.distributed could not start: {str(e).splitlines()[0]}"
    ) from None
  done.set()
  if args.process_id == 0:
    # Process 0 leaves last (the others wait in the barrier while it finishes its own work, e.g. writing results),
    # so only its wait means a process is gone. Its handler runs before jax's own (atexit is last-in,
    # first-out), which then finds nothing to do; the watchdog thread starts now (none can once exiting).
    threading.Thread(
      target=_shutdown_watchdog,
      args=(args.distributed_heartbeat_timeout_s / 2,),
      name="distributed-shutdown-watchdog",
      daemon=True,
    ).start()
    atexit.register(_shutdown)
  _check_devices()


_EXITING, _LEFT = threading.Event(), threading.Event()


def _shutdown() -> None:
  """Process 0's leave of jax.distributed at a clean exit. Its shutdown barrier waits for every process; one that
  has already stopped on its own (a SIGTERM to every process at once, as a service manager sends) would hold this
  one there until the coordination service aborts it (SIGABRT, status 134, after the shutdown timeout):
  ``_shutdown_watchdog`` ends the wait first, with a message and status 1."""
  import jax

  _EXITING.set()
  jax.distributed.shutdown()
  _LEFT.set()


def _shutdown_watchdog(wait_s: float) -> None:
  _EXITING.wait()
  if not _LEFT.wait(wait_s):
    fatal(
      f"another process stopped before this one could leave jax.distributed together with it (waited "
      f"{wait_s:.0f} s); exiting"
    )


def _check_port_free(address: str, port: int) -> None:
  """StartupError unless the coordinator port is free on every address (JAX binds [::]:PORT and would
  abort the process on a port it cannot bind)."""
  from hisparse_jax.engine.args import StartupError

  try:
    if socket.has_dualstack_ipv6():
      sock = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
      sock = socket.create_server(("0.0.0.0", port))
    sock.close()
  except OSError as e:
    raise StartupError(
      f"--coordinator-address {address}: process 0 cannot listen on port {port}: {e.strerror}"
    ) from None


def _check_devices() -> None:
  """StartupError (on every process alike: each sees the same device list) unless every process has the same
  number of devices, which JAX's multi-process collectives assume."""
  import collections

  import jax

  from hisparse_jax.engine.args import StartupError

  counts = collections.Counter(d.process_index for d in jax.devices())
  if len(set(counts.values())) > 1:
    listed = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
    raise StartupError(
      f"the processes have different numbers of devices ({listed}); give every process the same "
      "(XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU)"
    )


def startup_barrier(error: str | None) -> None:
  """Every process calls this at the same point of its start-up with its own start-up error (None: fine);
  all of them raise the same StartupError when any process has one, so that a check only one process makes
  (process 0 reads the prompts, binds the port) stops them all at once, cleanly. One process: raises its own."""
  import jax
  from jax.experimental import multihost_utils

  from hisparse_jax.engine.args import StartupError

  if jax.process_count() == 1:
    if error is not None:
      raise StartupError(error)
    return
  data = (error or "").encode()[:SETTINGS_BYTES]
  buf = np.zeros(SETTINGS_BYTES + 4, np.uint8)
  buf[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
  buf[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
  everyone = np.asarray(multihost_utils.process_allgather(buf))
  for p in range(jax.process_count()):
    n = int.from_bytes(everyone[p, :4].tobytes(), "little")
    if n:
      theirs = everyone[p, 4 : 4 + n].tobytes().decode(errors="replace")
      raise StartupError(theirs if p == jax.process_index() else f"process {p}: {theirs}")


def _native_stdout_to_stderr() -> None:
  """Native code's writes to file descriptor 1 go to stderr from now on, Python's ``sys.stdout`` keeps the real
  stdout: gloo prints a line per connection ("[Gloo] Rank 0 is connected to ...") there, which would mix into
  the results of ``generate`` on stdout."""
  sys.stdout.flush()
  real = os.dup(1)
  os.dup2(2, 1)
  sys.stdout = os.fdopen(real, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def _wait_for_coordinator(host: str, port: int, timeout: float, address: str) -> None:
  from hisparse_jax.engine.args import StartupError

  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host, port), timeout=1.0):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise StartupError(
          f"--coordinator-address {address}: no coordinator answered within "
          f"--distributed-init-timeout-s {timeout} ({e.strerror or e}); start process 0 "
          "(--process-id 0) with the same --coordinator-address"
        ) from None
      time.sleep(0.25)


def fatal(message: str, before_exit=()) -> None:
  """Prints ``[hisparse] process I of N: message`` to stderr, calls each of ``before_exit`` (a program's own
  last words: what it has finished, written; an exception it raises is printed, not raised) and ends the
  process at once with status 1 (no interpreter shutdown: it would wait in jax.distributed's shutdown barrier
  for a process that is gone)."""
  print(f"[hisparse] {_WHO[0]}: {message}", file=sys.stderr, flush=True)
  for hook in before_exit:
    try:
      hook()
    except BaseException as e:  # noqa: BLE001 - exiting anyway
      print(f"[hisparse] {_WHO[0]}: while exiting: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)


def exit_with_error(message: str) -> None:
  """A start-up error's end: prints the message to stderr and ends the process at once with status 1. No
  interpreter shutdown: with several processes joined it would wait in jax.distributed's shutdown barrier for the
  others, which may be waiting in a collective for this one; on one process, threads a failed start left behind
  (orbax's restore of a damaged checkpoint) print "Event loop is closed" tracebacks after the message."""
  import jax

  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  if jax.distributed.is_initialized() and jax.process_index() == 0:
    time.sleep(EXIT_GRACE_S)  # the coordination service lives here: let the others, stopping alike, go first
  os._exit(1)


# ------------------------------------------------------------------------------------------- messages
def encode(message: dict, arrays: list[np.ndarray] = ()) -> bytes:
  """A JSON-able dict plus raw arrays -> bytes: u32 header length, JSON header (the dict and each array's
  dtype name and shape), the arrays' bytes in order."""
  header = json.dumps(
    {"message": message, "arrays": [[np.dtype(a.dtype).name, list(a.shape)] for a in arrays]}
  ).encode()
  return len(header).to_bytes(4, "little") + header + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def decode(data: bytes) -> tuple[dict, list[np.ndarray]]:
  """The inverse of ``encode``."""
  import jax.numpy as jnp  # dtype names such as bfloat16

  n = int.from_bytes(data[:4], "little")
  header = json.loads(data[4 : 4 + n])
  arrays, at = [], 4 + n
  for name, shape in header["arrays"]:
    dt = np.dtype(jnp.dtype(name))
    size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    arrays.append(np.frombuffer(data, dt, count=size // dt.itemsize, offset=at).reshape(shape).copy())
    at += size
  return header["message"], arrays


class Broadcast:
  """Bytes from process 0 to every process (``multihost_utils.broadcast_one_to_all``). Every process calls
  ``exchange`` at the same point; process 0's payload is returned everywhere."""

  def __init__(self):
    import jax

    self.is_leader = jax.process_index() == 0

  def exchange(self, payload: bytes | None = None) -> bytes:
    from jax.experimental import multihost_utils

    head = np.zeros(FRAME, np.uint8)
    if self.is_leader:
      n = len(payload)
      head[:8] = np.frombuffer(n.to_bytes(8, "little"), np.uint8)
      first = payload[: FRAME - 8]
      head[8 : 8 + len(first)] = np.frombuffer(first, np.uint8)
    head = np.asarray(multihost_utils.broadcast_one_to_all(head))
    n = int.from_bytes(head[:8].tobytes(), "little")
    data = head[8 : 8 + min(n, FRAME - 8)].tobytes()
    rest = n - len(data)
    if rest > 0:
      buf = np.zeros(1 << (rest - 1).bit_length(), np.uint8)
      if self.is_leader:
        buf[:rest] = np.frombuffer(payload[FRAME - 8 :], np.uint8)
      data += np.asarray(multihost_utils.broadcast_one_to_all(buf))[:rest].tobytes()
    return data


_SETTING_FLAGS = {"record_topk": "--dump-topk"}  # settings whose flag has another name


def check_same(settings: dict) -> None:
  """Every process compares its settings (a JSON-able dict of the flags that shape the programs it runs)
  with every other's; all of them raise the same StartupError, naming the first flag that differs and the
  processes' values, when they differ. Call at the same point on every process."""
  import jax
  from jax.experimental import multihost_utils

  from hisparse_jax.engine.args import StartupError

  data = json.dumps(settings, sort_keys=True).encode()
  if len(data) > SETTINGS_BYTES:
    raise StartupError(f"internal: the engine settings take {len(data)} bytes, more than {SETTINGS_BYTES}")
  buf = np.zeros(SETTINGS_BYTES + 4, np.uint8)
  buf[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
  buf[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
  everyone = np.asarray(multihost_utils.process_allgather(buf))  # [processes, bytes]
  mine = settings
  for p in range(jax.process_count()):
    n = int.from_bytes(everyone[p, :4].tobytes(), "little")
    theirs = json.loads(everyone[p, 4 : 4 + n].tobytes())
    for key in sorted(set(mine) | set(theirs)):
      if mine.get(key) != theirs.get(key) and p != jax.process_index():
        if key == "model_fingerprint":
          raise StartupError(
            f"--model-path: process {p} has another model (its config.json or weights differ "
            f"from process {jax.process_index()}'s); every process needs the same checkpoint"
          )
        flag = _SETTING_FLAGS.get(key, "--" + key.replace("_", "-"))
        shown = lambda v: "unset" if v is None else repr(v)  # noqa: E731 - (a flag left at its default None)
        raise StartupError(
          f"{flag} differs between processes: {shown(mine.get(key))} here (process "
          f"{jax.process_index()}), {shown(theirs.get(key))} on process {p}; start every process "
          "with the same flags"
        )


class Lockstep:
  """The engine's link to the other processes (see the module docstring). The leader ``publish``es each
  step's changes; a follower ``receive``s them."""

  def __init__(self):
    import jax

    self.process = jax.process_index()
    self.processes = jax.process_count()
    self.is_leader = self.process == 0
    self.channel = Broadcast()
    self.last_sent = time.monotonic()
    self.closed = False
    self.messages = 0  # sent (leader) or received (follower)
    self.seconds = 0.0  # spent in them (a follower's includes waiting for the leader)
    self.kinds = collections.Counter()  # messages by kind ("step", "ops", "idle", "stop")
    self.recent = collections.deque(maxlen=4096)  # the last messages' seconds, for a median
    # Called (in order, on the thread that found it) when contact is lost, before the process exits: a program
    # writes what it has finished (the batch script's top-k trace and summary).
    self.on_lost: list = []

  def publish(self, kind: str, ops: list, check: list, arrays: list) -> None:
    """Leader: sends one message (kind "step", "ops", "idle" or "stop") with the changes since the last one."""
    start = time.perf_counter()
    self.channel.exchange(encode({"kind": kind, "ops": ops, "check": check}, arrays))
    self._count(kind, time.perf_counter() - start)
    self.last_sent = time.monotonic()
    self.closed = kind == "stop"

  def receive(self) -> tuple[dict, list[np.ndarray]]:
    """Follower: the leader's next message."""
    start = time.perf_counter()
    data = self.channel.exchange()
    seconds = time.perf_counter() - start
    msg, arrays = decode(data)
    self._count(msg.get("kind"), seconds)
    return msg, arrays

  def _count(self, kind, seconds: float) -> None:
    self.seconds += seconds
    self.messages += 1
    self.kinds[kind] += 1
    self.recent.append(seconds)

  def summary(self, elapsed: float) -> str:
    """One line on the messages so far, for a run's end: their count by kind, the median time of the last
    4096 (a message is a collective over every process, so it also waits for the slowest one to reach it: the
    first ones include every process's compilation) and their total share of ``elapsed`` seconds."""
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
    median = 1e3 * float(np.median(self.recent)) if self.recent else 0.0
    return (
      f"{self.processes} processes: {self.messages} messages to the followers ({kinds}), median {median:.2f} "
      f"ms; {self.seconds:.2f} s in all ({self.seconds / max(elapsed, 1e-9):.1%} of the run), waiting for the "
      "slowest process included (its compilations too)"
    )

  def idle_due(self) -> bool:
    return time.monotonic() - self.last_sent >= IDLE_HEARTBEAT_S

  def lost(self, error: BaseException) -> None:
    """A collective (a step, a message) failed: another process is gone or out of step. Exits (``fatal``)."""
    peer = "process 0 (the leader)" if not self.is_leader else "a follower process"
    fatal(
      f"lost contact with {peer}, or the processes fell out of step: {type(error).__name__}: "
      f"{str(error).splitlines()[0] if str(error) else ''}; exiting",
      before_exit=self.on_lost,
    )
