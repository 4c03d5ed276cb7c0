"""Several processes form one mesh (hisparse_jax/distributed.py), as on several hosts: N local processes on
loopback, each with its own simulated CPU devices, give one process's tokens from the batch script and the
gRPC server; a process that dies takes the others down with a message; start-up errors name the flag."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
from tests.multiprocess import REPO, free_port, launch, wait_all
from tests.tiny_model import tiny_wide_model_dir
from tests.xla_env import with_devices

# Prompts shorter and longer than the hot buffer (16) and than a prefill chunk (32 here).
PROMPTS = [list(range(5, 10)), [11, 12, 13], list(range(21, 41)), list(range(100, 150))]
HS = '{"top_k": 8, "device_buffer_size": 16, "host_to_device_ratio": 4}'
COMMON = ["--max-seq-len=256", "--page-size=16", "--chunked-prefill-size=32", "--max-running-requests=4"]


def _prompts(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
  return path


def _generate(tmp_path, name, flags, processes=1, devices=1):
  """Output lines of the batch script run as `processes` processes of `devices` devices each."""
  out = tmp_path / f"{name}.jsonl"
  args = [
    "-m",
    "hisparse_jax.generate",
    f"--model-path={tiny_wide_model_dir()}",
    f"--prompts={_prompts(tmp_path)}",
    f"--output={out}",
    "--max-new-tokens=8",
    *COMMON,
    *flags,
  ]
  if processes == 1:
    r = subprocess.run(
      [sys.executable, *args],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
      env={**os.environ, "XLA_FLAGS": with_devices(devices), "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
  else:
    results = wait_all(launch(args, processes, devices), timeout=600)
    for i, (rc, _, err) in enumerate(results):
      assert rc == 0, f"process {i}: {err[-3000:]}"
    # Process 0's summary counts its messages by kind; the follower took one engine step per "step" message.
    summary = re.search(
      r"\[generate\] 2 processes: (\d+) messages to the followers \(([^)]*)\), median [\d.]+ ms", results[0][2]
    )
    followed = re.search(r"followed process 0 for (\d+) steps", results[1][2])
    assert summary and followed, (results[0][2][-2000:], results[1][2][-2000:])
    kinds = {k: int(n) for n, k in (part.split() for part in summary[2].split(", "))}
    assert kinds["step"] == int(followed[1]) > 0 and kinds["stop"] == 1 and sum(kinds.values()) == int(summary[1])
  return [json.loads(line) for line in out.read_text().splitlines()]


HISPARSE = ["--enable-hisparse", f"--hisparse-config={HS}"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """The batch script on one process and one device: HiSparse, full-batch steps (dense gives the same tokens:
  lossless)."""
  lines = _generate(tmp_path_factory.mktemp("one"), "one", [*HISPARSE, "--deterministic"])
  assert len(lines) == len(PROMPTS) and all(len(r["output_ids"]) == 8 for r in lines)
  assert sum(r["misses"] for r in lines) > 0  # prompts past the hot buffer swapped rows in
  return lines


def test_a_submitted_request_reaches_the_followers_whole():
  """What process 0 sends its followers for a submitted request (JSON, its prompt KV as arrays) rebuilds it with
  every field that decides its schedule and tokens, its DP group pin and client included (dropped before: a
  follower could put a pinned request in another group than process 0, and the two fall out of step). Every other
  Request field is the engine's output or state, or stays on process 0 (named here: a new input field must be
  sent)."""
  import dataclasses
  import numpy as np
  from hisparse_jax.engine import Request
  from hisparse_jax.engine.engine import _SHARED_FIELDS, _request_fields, _request_from_fields

  req = Request(
    "r",
    [3, 4, 5],
    7,
    temperature=0.5,
    top_k=3,
    top_p=0.9,
    seed=11,
    stop_token_ids=frozenset({9, 2}),
    stop=("ab",),
    include_stop_str_in_output=True,
    ignore_eos=True,
    first_token=6,
    dp_group=1,
    client="c",
    prompt_kv=(np.ones((2, 4, 3), np.float32), np.zeros((2, 4, 1), np.float32)),
  )
  arrays = []
  back = _request_from_fields(json.loads(json.dumps(_request_fields(req, arrays))), arrays)
  for name in _SHARED_FIELDS:
    want = getattr(req, name)
    assert (sorted(getattr(back, name)) if name == "stop_token_ids" else getattr(back, name)) == (
      sorted(want) if name == "stop_token_ids" else want
    ), name
  assert all(np.array_equal(a, b) for a, b in zip(back.prompt_kv, req.prompt_kv))
  local = {
    "on_token",
    "prompt_kv",
    "export_kv",
    "prefill_seconds",
    "transfer_seconds",
    "transfer_bytes",
    "output_ids",
    "text",
    "text_sent",
    "finish_reason",
    "error",
    "matched_stop",
    "hits",
    "misses",
    "layer_hits",
    "layer_misses",
    "prefetched",
    "layer_prefetched",
    "topk_trace",
    "num_preemptions",
    "times_passed",
    "arrival",
    "first_token_time",
    "finish_time",
    "phase",
    "kv",
    "prefill_ids",
    "prefilled",
    "fair_tag",
    "_detok",
    "_stops",
    "_submitted",
  }
  assert {f.name for f in dataclasses.fields(Request)} - set(_SHARED_FIELDS) == local


@pytest.mark.parametrize(
  "mode,flags",
  [
    (
      "hisparse dp2 tp4 ep8, full-batch steps",
      [*HISPARSE, "--dp-size=2", "--tp-size=4", "--ep-size=8", "--deterministic"],
    ),
    ("dense tp8 ep8, bucketed steps", ["--tp-size=8", "--ep-size=8"]),
  ],
)
def test_batch_script_on_two_processes_gives_one_process_tokens(tmp_path, one_device, mode, flags):
  """2 processes x 4 CPU devices: the tokens (and HiSparse hits/misses) of one process on one device."""
  two = _generate(tmp_path, "two", flags, processes=2, devices=4)
  if "--enable-hisparse" in flags:
    assert two == one_device, mode
  else:
    assert [r["output_ids"] for r in two] == [r["output_ids"] for r in one_device], mode


def _start_servers(extra_flags=(), devices=2):
  """A 2-process server (process 0 serves gRPC): (processes, stub, port)."""
  args = [
    "run_server.py",
    f"--model-path={tiny_wide_model_dir()}",
    "--port=0",
    "--enable-hisparse",
    f"--hisparse-config={HS}",
    "--dp-size=2",
    "--tp-size=2",
    "--ep-size=4",
    "--deterministic",
    *COMMON,
    "--distributed-heartbeat-timeout-s=10",
    *extra_flags,
  ]
  procs = launch(args, 2, devices)
  line = procs[0].stdout.readline()
  while line and "listening on" not in line:
    line = procs[0].stdout.readline()
  assert "listening on" in line, procs[0].stderr.read()[-3000:] if procs[0].poll() is not None else line
  port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
  return procs, hisparse_pb2_grpc.HiSparseInferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def _tokens(stub, prompt, n=8):
  msgs = list(
    stub.Generate(
      hisparse_pb2.GenerateRequest(input_ids=hisparse_pb2.TokenIds(ids=prompt), max_new_tokens=n), timeout=120
    )
  )
  assert msgs[-1].finished
  return [t for m in msgs for t in m.token_ids]


def _kill_all(procs):
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.communicate()


def test_server_on_two_processes(one_device):
  """Process 0 serves gRPC, process 1 follows: concurrent streams get one process's tokens, an aborted stream
  leaves the others exact, and SIGTERM stops both processes cleanly."""
  import concurrent.futures

  want = [r["output_ids"] for r in one_device]
  procs, stub = _start_servers()
  try:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      got = list(pool.map(lambda p: _tokens(stub, p), PROMPTS))
    assert got == want
    # A stream cancelled mid-way (its request aborted on every process), then the others are still exact.
    call = stub.Generate(
      hisparse_pb2.GenerateRequest(
        input_ids=hisparse_pb2.TokenIds(ids=PROMPTS[3]), max_new_tokens=200, ignore_eos=True
      ),
      timeout=120,
    )
    next(call)
    call.cancel()
    assert _tokens(stub, PROMPTS[2]) == want[2]
    loads = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=30)
    assert loads.running == 0 and loads.queued == 0
    procs[0].send_signal(signal.SIGTERM)
    results = wait_all(procs, timeout=120)
    assert [rc for rc, _, _ in results] == [0, 0], [e[-2000:] for _, _, e in results]
    assert "process 0 stopped after" in results[1][1]
  finally:
    _kill_all(procs)


def test_sigterm_to_process_0_while_a_stream_decodes_stops_both_processes_cleanly():
  """The embedded default model over 2 processes (tp 2): SIGTERM to process 0 while a long stream decodes. The
  stream is cut after --shutdown-grace-s, and both processes exit 0: the stop message, sent from the server's
  main thread, first waits for the decode step launched ahead (XLA:CPU orders one thread's programs, not two
  threads'; before, the stop's collective met that step's on the follower out of order and gloo aborted it,
  status 134, reproduced 2 of 2 runs; the tiny test model's steps are too short to show it)."""
  import threading

  procs = launch(
    [
      "run_server.py",
      "--port=0",
      "--tp-size=2",
      "--max-running-requests=2",
      "--max-seq-len=1024",
      "--shutdown-grace-s=1",
      "--distributed-heartbeat-timeout-s=10",
    ],
    2,
    1,
  )
  try:
    line = procs[0].stdout.readline()
    while line and "listening on" not in line:
      line = procs[0].stdout.readline()
    assert "listening on" in line, procs[0].stderr.read()[-3000:] if procs[0].poll() is not None else line
    port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    stub = hisparse_pb2_grpc.HiSparseInferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    call = stub.Generate(
      hisparse_pb2.GenerateRequest(input_ids=hisparse_pb2.TokenIds(ids=[5, 6, 7]), max_new_tokens=900, ignore_eos=True),
      timeout=300,
    )
    for _ in range(20):  # decoding at full speed (past compilation)
      next(call)
    cut = {}

    def drain():
      try:
        for _ in call:
          pass
      except grpc.RpcError as e:
        cut["code"] = e.code()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    procs[0].send_signal(signal.SIGTERM)
    results = wait_all(procs, timeout=120)
    assert [rc for rc, _, _ in results] == [0, 0], [e[-2000:] for _, _, e in results]
    assert "process 0 stopped after" in results[1][1] and "[server] stopped" in results[0][1]
    assert "[server] shutting down: 1 stream open, given --shutdown-grace-s 1 to finish" in results[0][1]
    reader.join(30)
    assert cut.get("code") == grpc.StatusCode.UNAVAILABLE  # cut after the grace period, not finished
  finally:
    _kill_all(procs)


def test_a_two_process_decode_server_imports_prefilled_kv(one_device):
  """Disaggregation with a decode server of 2 processes: a one-process prefill server computes each prompt's KV,
  process 0 pulls it and ships it to process 1 in the step message, and every process writes it into its own
  pools (a device_put from process 0's device to the mesh would be a cross-host transfer, which the CPU backend
  refuses): the tokens are one process's."""
  prefill = subprocess.Popen(
    [
      sys.executable,
      "run_server.py",
      f"--model-path={tiny_wide_model_dir()}",
      "--port=0",
      "--disaggregation-mode=prefill",
      "--deterministic",
      *COMMON,
    ],
    cwd=REPO,
    env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": with_devices(1)},
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  procs = []
  try:
    line = prefill.stdout.readline()
    while line and "listening on" not in line:
      line = prefill.stdout.readline()
    assert "listening on" in line, prefill.stderr.read()[-3000:] if prefill.poll() is not None else line
    prefill_port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    procs, stub = _start_servers(["--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{prefill_port}"])
    assert [_tokens(stub, p) for p in PROMPTS] == [r["output_ids"] for r in one_device]
    procs[0].send_signal(signal.SIGTERM)
    results = wait_all(procs, timeout=120)
    assert [rc for rc, _, _ in results] == [0, 0], [e[-2000:] for _, _, e in results]
  finally:
    _kill_all([*procs, prefill])


GONE_FOLLOWER = """
import os, sys
from absl import flags
from hisparse_jax import distributed
distributed.DistributedArgs.define_flags()
flags.FLAGS(sys.argv)
args = distributed.DistributedArgs.from_flags()
distributed.initialize(args)
if args.process_id == 1:
  os._exit(0)  # gone without leaving jax.distributed (it stopped on its own SIGTERM, say)
print("process 0 finished its work", flush=True)
"""


def test_process_0_does_not_wait_for_a_follower_that_is_gone():
  """A service manager stops a deployment by signalling every process at once; a follower that stopped on its
  own is gone when process 0 exits cleanly. Process 0 must not wait in jax.distributed's shutdown barrier until
  the coordination service aborts it (SIGABRT, status 134): status 1 and a message, within half the heartbeat
  timeout."""
  results = wait_all(launch(["-c", GONE_FOLLOWER, "--distributed-heartbeat-timeout-s=6"], 2, 1), timeout=120)
  assert results[1][0] == 0
  rc, out, err = results[0]
  assert "process 0 finished its work" in out
  assert rc == 1 and "another process stopped before this one could leave jax.distributed" in err, (rc, err[-3000:])
  assert "Fatal Python error" not in err


@pytest.mark.parametrize("victim,sig", [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGTERM)])
def test_a_process_that_dies_takes_the_other_down_with_a_message(victim, sig):
  """kill -9 of the follower (mid-stream) or of the leader, or SIGTERM to the follower: the survivor exits with
  status 1 within seconds, saying it lost the other process; the stream ends with an error, not a hang."""
  procs, stub = _start_servers()
  try:
    call = stub.Generate(
      hisparse_pb2.GenerateRequest(
        input_ids=hisparse_pb2.TokenIds(ids=PROMPTS[1]), max_new_tokens=200, ignore_eos=True
      ),
      timeout=120,
    )
    next(call)
    procs[victim].send_signal(sig)
    if sig == signal.SIGTERM:  # the follower stops at once, saying so
      _, err = procs[victim].communicate(timeout=60)
      assert procs[victim].returncode == 1 and "SIGTERM: stopping" in err, err[-2000:]
    start = time.monotonic()
    with pytest.raises(grpc.RpcError):
      for _ in call:
        pass
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=60)
    assert time.monotonic() - start < 45
    assert survivor.returncode != 0
    # Ours ("lost contact with ...") or, when the coordination service goes first, JAX's own.
    assert "lost contact with" in err or "another task died" in err, err[-3000:]
  finally:
    _kill_all(procs)


@pytest.mark.parametrize("who,sig", [(1, signal.SIGINT), (0, signal.SIGTERM)])
def test_signals_to_a_two_process_batch_run(tmp_path, who, sig):
  """Ctrl-C to the follower: it stops at once saying so, and process 0 follows with a message (exit 1 both),
  having written what finished: its results and its --dump-topk trace. SIGTERM to process 0: as Ctrl-C, it
  writes what finished and exits 130; the follower stops with it (exit 0)."""
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(
    "".join(json.dumps({"input_ids": p, "max_new_tokens": 2 if i == 0 else 200}) + "\n" for i, p in enumerate(PROMPTS))
  )
  out, trace = tmp_path / "out.jsonl", tmp_path / "trace.npz"
  procs = launch(
    [
      "-m",
      "hisparse_jax.generate",
      f"--model-path={tiny_wide_model_dir()}",
      f"--prompts={prompts}",
      f"--output={out}",
      f"--dump-topk={trace}",
      *COMMON,
      "--tp-size=4",
    ],
    2,
    2,
  )
  try:
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n")) and time.monotonic() < deadline:  # the short one
      time.sleep(0.2)
    procs[who].send_signal(sig)
    results = wait_all(procs, timeout=60)
  finally:
    _kill_all(procs)
  if who == 1:
    assert results[1][0] == 1 and "SIGINT: stopping" in results[1][2], results[1][2][-2000:]
    # Process 0: ours, or JAX's own when its coordination service notices first (then SIGABRT, nothing more).
    err = results[0][2]
    assert results[0][0] != 0 and ("lost contact with a follower process" in err or "another task died" in err), err[
      -2000:
    ]
    if "lost contact with a follower process" in err:
      assert re.search(
        r"\[generate\] 1 result written to .*out.jsonl \(4 prompt lines read\); top-k trace of 1 "
        "finished request written to",
        err,
      ), err[-2000:]
  else:
    assert [rc for rc, _, _ in results] == [130, 0], [e[-2000:] for _, _, e in results]
    assert "[generate] interrupted:" in results[0][2] and "followed process 0 for" in results[1][2]
    assert "top-k trace of" in results[0][2]
  import numpy as np

  if trace.exists():
    assert "topk_1" in np.load(trace).files and len(json.loads(out.read_text().splitlines()[0])["output_ids"]) == 2


def _cli(*flags, processes=1, devices=1, timeout=120, extra=None):
  args = [
    "-m",
    "hisparse_jax.generate",
    f"--model-path={tiny_wide_model_dir()}",
    "--prompts=/nonexistent.jsonl",
    *flags,
  ]
  if processes == 1:
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return [(r.returncode, r.stdout, r.stderr)]
  return wait_all(launch(args, processes, devices, extra=extra), timeout=timeout)


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--num-processes=2"], "--num-processes 2 needs --coordinator-address HOST:PORT"),
    (["--num-processes=2", "--process-id=2", "--coordinator-address=127.0.0.1:1"], "--process-id 2: expected 0..1"),
    (["--num-processes=2", "--coordinator-address=nowhere"], "--coordinator-address 'nowhere': expected HOST:PORT"),
    (["--num-processes=0"], "--num-processes must be in [1, 65536]"),
    (["--num-processes=99999999999"], "--num-processes must be in [1, 65536]"),
    (
      ["--num-processes=2", "--coordinator-address=127.0.0.1:1", "--distributed-init-timeout-s=99999999999"],
      "--distributed-init-timeout-s must be in [1, 86400] seconds",
    ),
    (["--num-processes=2", "--coordinator-address=127.0.0.1:\u0661\u0662"], "expected HOST:PORT"),  # Arabic digits
    (["--num-processes=2", "--coordinator-address=::1:1234"], "an IPv6 address as [ADDRESS]:PORT"),
    (["--num-processes=2", "--coordinator-address=h o s t:1234"], "'h o s t' is not a host name or address"),
    (["--num-processes=2", "--coordinator-address=[]:1234"], "expected HOST:PORT"),
    (["--coordinator-address=nowhere"], "--coordinator-address 'nowhere': expected HOST:PORT"),  # even with 1 process
  ],
)
def test_bad_distributed_flags_exit_with_a_message(flags, message):
  [(rc, _, err)] = _cli(*flags)
  assert rc == 1 and message in err and "Traceback" not in err, err[-2000:]


def test_missing_coordinator_is_a_startup_error():
  """A follower whose process 0 never starts: exit 1 after --distributed-init-timeout-s, naming the flag."""
  start = time.monotonic()
  [(rc, _, err)] = _cli(
    f"--coordinator-address=127.0.0.1:{free_port()}",
    "--num-processes=2",
    "--process-id=1",
    "--distributed-init-timeout-s=2",
  )
  assert rc == 1 and "no coordinator answered within --distributed-init-timeout-s 2" in err, err[-2000:]
  assert "Traceback" not in err and time.monotonic() - start < 60


def test_missing_follower_and_taken_port_are_startup_errors():
  """Process 0 whose follower never joins exits 1 naming the flags; a coordinator port in use is refused."""
  [(rc, _, err)] = _cli(
    f"--coordinator-address=127.0.0.1:{free_port()}",
    "--num-processes=2",
    "--process-id=0",
    "--distributed-init-timeout-s=3",
  )
  assert rc == 1 and "not every process joined" in err and "--distributed-init-timeout-s 3" in err, err[-2000:]
  with socket.create_server(("127.0.0.1", 0)) as taken:
    port = taken.getsockname()[1]
    [(rc, _, err)] = _cli(f"--coordinator-address=127.0.0.1:{port}", "--num-processes=2", "--process-id=0")
  assert rc == 1 and f"--coordinator-address 127.0.0.1:{port}: process 0 cannot listen on port {port}" in err, err[
    -2000:
  ]


def test_a_startup_error_of_process_0_alone_stops_every_process():
  """Only process 0 reads the prompts: an unreadable --prompts stops both processes with its message, exit 1,
  no abort of the follower."""
  results = _cli(processes=2, devices=2)  # --prompts=/nonexistent.jsonl
  assert [rc for rc, _, _ in results] == [1, 1], [e[-2000:] for _, _, e in results]
  assert "--prompts '/nonexistent.jsonl'" in results[0][2] and "process 0: --prompts" in results[1][2]
  assert not any("Traceback" in e or "another task died" in e for _, _, e in results)


def test_a_startup_error_of_a_follower_alone_stops_every_process(tmp_path):
  """A follower whose own --model-path does not exist (found after the processes joined) stops every process at
  once with its message, exit 1: process 0 neither waits out a timeout nor aborts."""
  start = time.monotonic()
  results = _cli(
    f"--prompts={_prompts(tmp_path)}",
    "--tp-size=4",
    processes=2,
    devices=2,
    extra={1: ["--model-path=/nonexistent-model"]},
  )
  assert [rc for rc, _, _ in results] == [1, 1], [e[-2000:] for _, _, e in results]
  assert "process 1: --model-path '/nonexistent-model'" in results[0][2], results[0][2][-2000:]
  assert "--model-path '/nonexistent-model'" in results[1][2], results[1][2][-2000:]
  assert not any("Traceback" in e or "another task died" in e for _, _, e in results)
  assert time.monotonic() - start < 60


def test_processes_that_disagree_stop_at_startup(tmp_path):
  """Different engine flags on the two processes, or a mesh not covering every process's devices: every
  process exits 1 with a message naming the flag (before loading the model)."""
  prompts = _prompts(tmp_path)
  results = _cli(
    f"--prompts={prompts}",
    "--tp-size=4",
    processes=2,
    devices=2,
    extra={0: ["--max-running-requests=8"], 1: ["--max-running-requests=4"]},
  )
  for rc, _, err in results:
    assert rc == 1 and "--max-running-requests differs between processes" in err, err[-2000:]
  results = _cli(f"--prompts={prompts}", "--dp-size=2", processes=2, devices=2)
  for rc, _, err in results:
    assert rc == 1 and "the 2 processes have 4: with several processes the mesh covers every device" in err, err[-2000:]
  # Another checkpoint (same config.json, other weights) on process 1.
  other = tiny_wide_model_dir(seed=8)
  results = _cli(f"--prompts={prompts}", "--tp-size=4", processes=2, devices=2, extra={1: [f"--model-path={other}"]})
  for rc, _, err in results:
    assert rc == 1 and "--model-path: process" in err and "has another model" in err, err[-2000:]
  # Different numbers of devices per process.
  port = free_port()
  procs = launch(
    ["-m", "hisparse_jax.generate", f"--model-path={tiny_wide_model_dir()}", f"--prompts={prompts}", "--tp-size=6"],
    2,
    4,
    port=port,
    env_per_process={1: {"XLA_FLAGS": with_devices(2)}},
  )
  for rc, _, err in wait_all(procs, timeout=120):
    assert rc == 1 and "the processes have different numbers of devices (process 0: 4, process 1: 2)" in err, err[
      -2000:
    ]
