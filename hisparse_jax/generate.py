r"""Batch decoding (greedy unless a line asks to sample): a JSONL file of prompts in, a JSONL file of outputs out.

  python -m hisparse_jax.generate --prompts prompts.jsonl [--model-path DIR] \
      [--max-new-tokens 32] [--dtype float32|bfloat16] [--max-running-requests 64] \
      [--enable-hisparse [--hisparse-config '{"top_k": 32, "device_buffer_size": 64}'] \
      [--host-pool auto|jax|extension]] [--max-seq-len N] [--chunked-prefill-size 2048] \
      [--page-size 64] [--max-device-kv-bytes N] [--deterministic] [--kv-cache-dtype auto|fp8_e4m3] \
      [--output out.jsonl] [--dump-topk trace.npz]

Engine flags are ``hisparse_jax.engine.args.EngineArgs`` (shared with the server; ``--help`` lists them).

Input lines: ``{"text": "..."}`` or ``{"input_ids": [...]}``, optionally with
``"max_new_tokens"`` and the server's sampling and stop fields (SAMPLING_FIELDS: ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``, as
``Request`` defines them). Output: one line per non-blank input line, in input order, each written (and
flushed) as soon as it and every line before it are done, so an interrupted run keeps what it finished;
Ctrl-C (or SIGTERM) exits with status 130 and a one-line message, and a run whose every line was rejected with
status 1. ``--output`` and ``--dump-topk`` may be neither
the prompts file, nor each other, nor inside the model directory (start-up errors). Lines have
``output_ids`` (new tokens only), ``text`` (when the model has a tokenizer),
``finish_reason`` (with ``matched_stop`` when a stop string or token ended it), ``prompt_tokens``, ``hits``/``misses`` (swap-in counts, HiSparse only), ``prefetched`` (rows
the cross-layer prefetch copied, with ``"prefetch": "next_layer"``) — or
``{"error": ..., "code": ...}`` for a line that cannot be served (finish_reason ``"error"`` with an
``error`` message when a kernel refused the request's row mid-run); the others are decoded anyway. All requests run through one continuous-batching engine.
The prompts are read as the engine takes them (a file of any size, or a pipe that keeps writing: memory holds
the requests in flight, at most 4096 lines, or one per lane, read and not yet written); a line longer than any prompt the
engine could take fails alone.

``--dump-topk FILE.npz`` records the indexer's top-k positions at every decode
step of every layer: for input line N, ``topk_N`` int32[steps, layers, index_topk]
(-1 = padding, step t attends at seq_len = prompt_tokens + t + 1) and
``prompt_tokens_N`` (int). ``benchmarks/miss_rate.py --trace FILE.npz`` replays it.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import reprlib
import signal
import stat
import sys
import tempfile
import threading
import time

from absl import flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("prompts", None, "JSONL file of prompts ('-': standard input).", required=True)
flags.DEFINE_string("output", None, "JSONL output file (default: stdout).")
flags.DEFINE_integer("max-new-tokens", 32, "Tokens to generate per prompt unless the line says otherwise.")
flags.DEFINE_string(
  "dump-topk",
  None,
  "Write every request's per-step, per-layer top-k positions to this .npz "
  "(keys topk_<line>, prompt_tokens_<line>) for benchmarks/miss_rate.py --trace.",
)


# Requests kept waiting in the engine beyond its lanes, at least, and lines read but not yet written, at most
# (main(): the prompts are read as the engine needs them).
QUEUE_AHEAD = 64
MAX_QUEUE_AHEAD = 1024  # (however many lanes; the lines queued for the engine also hold READ_AHEAD_BYTES at most)
READ_AHEAD_BYTES = 64 << 20
MAX_PENDING = 4096  # (or more: every lane's request and the queue ahead)
WAIT_S = 0.2  # the longest an idle engine waits for a line before it looks at Ctrl-C again
_EOF = object()


class _RunError(Exception):
  """Reading the prompts or writing the output failed mid-run (an I/O error): the run stops as on a failed
  step, with this message and no traceback."""


MAX_NEW_TOKENS = 2**31 - 1  # token counts are int32 on the device; a line's own value is checked against the context


def _define_engine_flags():
  from hisparse_jax import distributed
  from hisparse_jax.engine import args

  args.EngineArgs.define_flags()
  distributed.DistributedArgs.define_flags()
  for module in (args, distributed):  # --help lists them with this program's own flags
    flags.adopt_module_key_flags(module)


_define_engine_flags()


# A line's optional sampling and stop fields, as the engine's Request (and the server's GenerateRequest) name them;
# the engine validates their values (a bad one fails its line alone).
SAMPLING_FIELDS = (
  "temperature",
  "top_p",
  "top_k",
  "seed",
  "stop",
  "stop_token_ids",
  "ignore_eos",
  "include_stop_str_in_output",
)
LINE_FIELDS = ("text", "input_ids", "max_new_tokens") + SAMPLING_FIELDS


def _parse_line(line: str, lineno: int, tokenizer, bos: int | None, default_max_new: int, max_prompt_bytes: int):
  """Returns (prompt_ids, max_new_tokens, sampling: {SAMPLING_FIELDS given: value}); raises ValueError with a
  message for a bad line (a ``text`` over ``max_prompt_bytes`` UTF-8 bytes is refused before it is tokenized,
  as the server does)."""
  try:
    line.encode("utf-8")
  except UnicodeEncodeError:
    raise ValueError(f"line {lineno}: not valid UTF-8") from None
  from hisparse_jax.config import RepeatedKey, unique_keys

  try:
    obj = json.loads(line, object_pairs_hook=unique_keys)
  except RepeatedKey as e:
    raise ValueError(f"line {lineno}: field {reprlib.repr(e.args[0])} is given more than once") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"line {lineno}: not JSON: {e}") from None
  except ValueError:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
    raise ValueError(f"line {lineno}: an integer of more than {sys.get_int_max_str_digits()} digits") from None
  except RecursionError:
    raise ValueError(f"line {lineno}: JSON nested too deeply") from None
  if not isinstance(obj, dict):
    raise ValueError(f"line {lineno}: expected a JSON object")
  unknown = set(obj) - set(LINE_FIELDS)
  if unknown:
    names = reprlib.Repr(maxlist=8, maxstring=64).repr(sorted(unknown))  # (a name may be megabytes long)
    raise ValueError(f"line {lineno}: unknown field(s) {names}; known: {', '.join(LINE_FIELDS)}")
  if ("text" in obj) == ("input_ids" in obj):
    raise ValueError(f"line {lineno}: give exactly one of 'text' or 'input_ids'")
  max_new = obj.get("max_new_tokens", default_max_new)
  if isinstance(max_new, bool) or not isinstance(max_new, int):
    raise ValueError(f"line {lineno}: max_new_tokens must be an integer")
  sampling = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
  for flag in ("ignore_eos", "include_stop_str_in_output"):
    if not isinstance(sampling.get(flag, False), bool):
      raise ValueError(f"line {lineno}: {flag} must be true or false")
  for name in ("stop", "stop_token_ids"):  # (a JSON list: the engine checks its items)
    if isinstance(sampling.get(name), list):
      sampling[name] = tuple(sampling[name])
  if "text" in obj:
    if not isinstance(obj["text"], str):
      raise ValueError(f"line {lineno}: 'text' must be a string")
    try:
      obj["text"].encode("utf-8")
    except UnicodeEncodeError:
      raise ValueError(f"line {lineno}: 'text' is not valid Unicode (a lone surrogate escape)") from None
    if len(obj["text"].encode("utf-8")) > max_prompt_bytes:
      raise ValueError(f"line {lineno}: text prompt over {max_prompt_bytes} bytes (--max-prompt-bytes)")
    if tokenizer is None:
      raise ValueError(f"line {lineno}: 'text' given but the model directory has no tokenizer.json")
    from hisparse_jax.engine.detokenizer import encode_prompt

    return encode_prompt(tokenizer, obj["text"], bos), max_new, sampling
  ids = obj["input_ids"]
  if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
    raise ValueError(f"line {lineno}: 'input_ids' must be a list of integers")
  return ids, max_new, sampling


def _check_writable_dir(flag: str, path: str) -> None:
  """StartupError unless a file can be created in ``path``'s folder (a scratch file, removed at once: an existing
  file at ``path`` is left untouched until there is something to write)."""
  from hisparse_jax.engine.args import StartupError

  if os.path.isdir(path):
    raise StartupError(f"{flag} {path!r}: is a directory")
  try:
    with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(path))):
      pass
  except OSError as e:
    raise StartupError(f"{flag} {path!r}: {e.strerror} (cannot create a file in its folder)") from None


def _same_file(a: str, b: str) -> bool:
  return os.path.realpath(a) == os.path.realpath(b) or (
    os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
  )


def _prompts_path(path: str) -> str:
  return "/dev/stdin" if path == "-" else path  # (the file or pipe stdin is, for the same-file checks)


def open_prompts(path: str):
  """The prompts file at ``path`` opened for reading (binary): a file, a pipe or FIFO, a terminal or /dev/null;
  "-" is standard input. StartupError for another device (/dev/zero, /dev/urandom: they never end) or when it
  cannot be opened."""
  from hisparse_jax.engine.args import StartupError

  try:
    f = os.fdopen(os.dup(sys.stdin.fileno()), "rb") if path == "-" else open(path, "rb")
  except (OSError, ValueError) as e:  # (ValueError: stdin closed)
    raise StartupError(f"--prompts {path!r}: {e}") from None
  st = os.fstat(f.fileno())
  if stat.S_ISCHR(st.st_mode) and not os.isatty(f.fileno()) and st.st_rdev != os.stat(os.devnull).st_rdev:
    f.close()
    raise StartupError(f"--prompts {path!r} is a device, not a file, pipe, terminal or /dev/null")
  return f


def prompt_lines(f, max_line_bytes: int):
  """Yields (line number from 1, line) for each non-blank line of the binary file ``f``, read as it is needed
  (memory holds one line, whatever the file's size or a pipe's length). Lines are split on \\n only (JSON
  strings may hold U+2028), a trailing \\r is dropped, and bytes that are not UTF-8 are kept as surrogates so
  that such a line fails alone (_parse_line). A line of more than ``max_line_bytes`` bytes is yielded as None
  (it fails alone) and skipped, read on in 1 MiB pieces without keeping them. OSError as the file raises it."""
  lineno = 0
  while True:
    raw = f.readline(max_line_bytes + 1)
    if not raw:
      return
    lineno += 1
    if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
      while raw and not raw.endswith(b"\n"):
        raw = f.readline(1 << 20)
      yield lineno, None
      continue
    if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (some editors write one)
      raw = raw[3:]
    line = raw.decode("utf-8", "surrogateescape").rstrip("\n").rstrip("\r")
    if line.strip():
      yield lineno, line


def _open_prompts_and_check_outputs(dump: str | None, model_dir: str):
  """The prompts file, open (``open_prompts``); StartupError (before the model loads) for an unreadable
  --prompts, or an --output / --dump-topk that cannot be written or would overwrite an input: the prompts file,
  the other output, or anything in the --model-path directory."""
  f = open_prompts(FLAGS.prompts)
  try:
    _check_outputs(dump, model_dir)
  except BaseException:
    f.close()
    raise
  return f


def _check_outputs(dump: str | None, model_dir: str) -> None:
  from hisparse_jax.engine.args import StartupError

  outputs = []
  if FLAGS.output is not None:
    if not FLAGS.output:
      raise StartupError("--output '': an empty file name (leave the flag out to write to stdout)")
    outputs.append(("--output", FLAGS.output))
  if dump is not None:
    if not dump.endswith(".npz") or os.path.basename(dump) == ".npz":
      raise StartupError(f"--dump-topk {dump!r}: the file name must end in .npz")
    outputs.append(("--dump-topk", dump))
  model_root = os.path.realpath(model_dir)
  for i, (flag, path) in enumerate(outputs):
    if _same_file(path, _prompts_path(FLAGS.prompts)):
      raise StartupError(f"{flag} {path!r} is the --prompts file; writing it would destroy the prompts")
    if os.path.commonpath([model_root, os.path.realpath(path)]) == model_root:
      raise StartupError(f"{flag} {path!r} is inside the --model-path directory {model_dir}; write it elsewhere")
    for other_flag, other in outputs[:i]:
      if _same_file(path, other):
        raise StartupError(f"{flag} {path!r} is the {other_flag} file; give them different names")
    _check_writable_dir(flag, path)


def _write_topk_dump(path: str, traces, layers: int, topk: int) -> None:
  """Writes --dump-topk (module docstring) for ``traces``, [(line number, finished Request)], next to ``path``
  and renames it there: an existing trace is replaced whole or not at all. OSError as the file system raises it."""
  import numpy as np

  from models.from_torch import usual_modes

  arrays = {}
  for lineno, req in traces:
    steps = np.stack(req.topk_trace) if req.topk_trace else np.zeros((0, layers, topk), np.int32)
    arrays[f"topk_{lineno}"] = steps.astype(np.int32)
    arrays[f"prompt_tokens_{lineno}"] = np.int64(len(req.prompt_ids))
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".npz")
  try:
    with os.fdopen(fd, "wb") as f:
      np.savez_compressed(f, **arrays)
    usual_modes(tmp)  # (mkstemp's is owner-only; --output's is the umask's)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def _follow(args, tokenizer, record_topk: bool) -> None:
  """A process other than 0 of a multi-process run: the same engine, stepping as process 0 says."""
  import jax

  from hisparse_jax import distributed
  from hisparse_jax.engine import Engine

  engine = Engine(args, tokenizer=tokenizer, record_topk=record_topk)
  try:
    steps = engine.follow()
  except distributed.DistributedError as e:  # process 0 stopped on an error of its own: the same exit
    sys.exit(f"error: process 0: {e}")
  print(
    f"[generate] process {jax.process_index()} of {jax.process_count()}: followed process 0 for {steps} steps",
    file=sys.stderr,
  )


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from hisparse_jax import distributed
  from hisparse_jax.engine.args import EngineArgs, StartupError, load_tokenizer_or_fail, reserve_device_memory

  dist = distributed.DistributedArgs.from_flags()
  try:
    reserve_device_memory()  # (before JAX starts its GPU client; a bad value in the environment is refused)
    args = EngineArgs.from_flags()
    args.validate()
    if not 1 <= FLAGS["max-new-tokens"].value <= MAX_NEW_TOKENS:
      raise StartupError(f"--max-new-tokens must be 1..{MAX_NEW_TOKENS}, got {FLAGS['max-new-tokens'].value}")
    distributed.initialize(dist)
    dump = FLAGS["dump-topk"].value
    prompts, error = None, None
    try:  # every process checks its model; process 0 alone reads the prompts and writes the results
      model_dir = args.model_dir()
      model_cfg = args.model_config(model_dir)
      tokenizer = load_tokenizer_or_fail(model_dir)
      if dist.process_id == 0:
        prompts = _open_prompts_and_check_outputs(dump, model_dir)
    except StartupError as e:
      error = str(e)
    distributed.startup_barrier(error)  # every process stops when one's checks fail, with its message
    if dist.process_id > 0:
      if FLAGS.output:
        print(
          f"[generate] process {dist.process_id}: --output {FLAGS.output!r} is not written here: process 0 "
          "writes the results",
          file=sys.stderr,
        )
      _follow(args, tokenizer, record_topk=dump is not None)
      return
    from hisparse_jax.engine import Engine

    engine = Engine(args, tokenizer=tokenizer, record_topk=dump is not None)
    output_existed = bool(FLAGS.output) and os.path.exists(FLAGS.output)
    try:  # writable? (appending truncates nothing: the file is replaced only once there is a result to write)
      if FLAGS.output:
        open(FLAGS.output, "a", encoding="utf-8").close()
    except OSError as e:
      engine.close(error=f"--output {FLAGS.output!r}: {e}")
      raise StartupError(f"--output {FLAGS.output!r}: {e}") from None
  except StartupError as e:
    distributed.exit_with_error(f"error: {e}")
  hisparse = engine.hisparse

  from hisparse_jax.engine import Request, RequestError

  # The prompts are read as the engine needs them (a 39-byte line became ~2.5 KB of Python objects: a whole file
  # read up front ran out of memory at a few hundred MB of short prompts). At least QUEUE_AHEAD requests (or two
  # per lane) wait in the engine, so admission, which may pass one that does not fit yet, has a queue to pick from;
  # at most MAX_PENDING lines are read and not yet written (a long request at the head of the output holds back
  # the results after it: reading stops until it is done). A line longer than any prompt the engine could take
  # fails alone: JSON text takes at most 6 bytes per byte of UTF-8 (\\u escapes), an id with its comma under 16.
  # A thread reads (a pipe's read blocks: decoding goes on meanwhile), at most queue_ahead lines ahead.
  max_line_bytes = 8 * engine.max_prompt_bytes + 16 * engine.max_seq_len + 4096
  queue_ahead = min(max(QUEUE_AHEAD, 2 * engine.num_slots), MAX_QUEUE_AHEAD)
  inbox = queue.Queue(maxsize=queue_ahead)  # (line number, line or None), then _EOF or the reader's exception
  read_ahead = threading.Condition()  # the inbox's lines hold at most READ_AHEAD_BYTES (+ one line)
  queued_bytes = [0]

  def reader() -> None:
    try:
      for item in prompt_lines(prompts, max_line_bytes):
        with read_ahead:
          read_ahead.wait_for(lambda: queued_bytes[0] < READ_AHEAD_BYTES)
          queued_bytes[0] += len(item[1] or "")
        inbox.put(item)
      inbox.put(_EOF)
    except Exception as e:  # noqa: BLE001 - an I/O error (or anything else) ends the run, not this thread alone
      inbox.put(e)

  threading.Thread(target=reader, name="prompts", daemon=True).start()
  max_pending = max(MAX_PENDING, engine.num_slots + queue_ahead)  # (every lane can be busy)
  pending: collections.deque[list] = collections.deque()  # [result or None], one per line read, in input order
  running: dict[str, tuple[list, int]] = {}  # request id -> (its pending entry, its line number)
  traces: list[tuple[int, Request]] = []  # with --dump-topk: every request, to write at the end
  totals = collections.Counter()
  eof = False
  read = written = flushed = 0
  dest = None if FLAGS.output else sys.stdout  # opened at the first result: a run that fails before keeps the file

  def read_more() -> None:
    nonlocal eof, read
    while not eof and len(engine.waiting) < queue_ahead and len(pending) < max_pending:
      try:  # with nothing to decode, wait for the next line (Ctrl-C is seen within WAIT_S)
        item = inbox.get(timeout=WAIT_S) if not engine.has_work() else inbox.get_nowait()
      except queue.Empty:
        if engine.has_work() or interrupted.is_set():
          break
        engine.idle()  # several processes: a heartbeat to the followers while the prompts come slowly
        continue
      if isinstance(item, Exception):
        raise _RunError(f"reading --prompts {FLAGS.prompts!r} failed: {item}")
      if item is _EOF:
        eof = True
        break
      lineno, line = item
      with read_ahead:
        queued_bytes[0] -= len(line or "")
        read_ahead.notify()
      read += 1
      entry = [None]
      pending.append(entry)
      if line is None:
        entry[0] = {
          "error": f"line {lineno}: over {max_line_bytes} bytes (longer than any prompt this engine takes)",
          "code": "INVALID_ARGUMENT",
        }
        continue
      try:
        ids, max_new, sampling = _parse_line(
          line, lineno, tokenizer, model_cfg.bos_token_id, FLAGS["max-new-tokens"].value, engine.max_prompt_bytes
        )
        req = Request(request_id=str(lineno), prompt_ids=ids, max_new_tokens=max_new, **sampling)
        engine.submit(req)
        running[req.request_id] = (entry, lineno)
        totals["requests"] += 1
      except RequestError as e:
        entry[0] = {"error": f"line {lineno}: {e}", "code": e.code}
      except Exception as e:  # noqa: BLE001 - one bad line must not sink the batch
        msg = str(e) if str(e).startswith(f"line {lineno}:") else f"line {lineno}: {type(e).__name__}: {e}"
        entry[0] = {"error": msg, "code": "INVALID_ARGUMENT"}

  def finished(req) -> None:
    entry, lineno = running.pop(req.request_id)
    out = {"output_ids": req.output_ids, "finish_reason": req.finish_reason, "prompt_tokens": len(req.prompt_ids)}
    if req.finish_reason == "error":  # a kernel refused this request's row; the others went on
      out["error"] = req.error
    if req.matched_stop:
      out["matched_stop"] = req.matched_stop
    if tokenizer is not None:
      out["text"] = req.text
    totals["tokens"] += len(req.output_ids)
    if hisparse is not None:
      out["hits"], out["misses"] = req.hits, req.misses
      totals["hits"] += req.hits
      totals["misses"] += req.misses
      if hisparse.prefetch != "none":
        out["prefetched"] = req.prefetched
        totals["prefetched"] += req.prefetched
    entry[0] = out
    if dump is not None:
      traces.append((lineno, req))

  def write_ready() -> None:  # the finished prefix of the results, in input order
    nonlocal written, flushed, dest
    try:
      while pending and pending[0][0] is not None:
        if dest is None:
          dest = open(FLAGS.output, "w", encoding="utf-8")
        dest.write(json.dumps(pending.popleft()[0], ensure_ascii=False) + "\n")
        written += 1
      if dest is not None:
        dest.flush()
      flushed = written
    except OSError as e:  # a full disk: the run stops, with one line
      written = flushed  # (lines left in the write buffer did not get there)
      raise _RunError(
        f"writing {'--output ' + repr(FLAGS.output) if FLAGS.output else 'stdout'} failed: "
        f"{e.strerror or e} (the last result counted as written may not be whole)"
      ) from None

  L, K = model_cfg.num_hidden_layers, model_cfg.index_topk

  def dump_traces() -> str:  # writes --dump-topk; what the summary says of it. OSError as the file system raises
    _write_topk_dump(dump, traces, L, K)
    return f"top-k trace of {len(traces)} finished request{'' if len(traces) == 1 else 's'} written to {dump}"

  def written_summary(dumped: str) -> str:
    where = FLAGS.output or "stdout"
    return (
      f"{written} result{'' if written == 1 else 's'} written to {where} ({read} prompt "
      f"line{'' if read == 1 else 's'} read)"
      + (f" (the earlier {where} is unchanged)" if output_existed and dest is None else "")
      + ("" if eof else "; --prompts was not read to its end")
      + (f"; {dumped}" if dumped else "")
    )

  def on_lost() -> None:  # a follower is gone: the process exits from inside a step (distributed.fatal)
    print(f"[generate] {written_summary(dump_traces() if dump is not None and traces else '')}", file=sys.stderr)

  if engine.lockstep is not None:
    engine.lockstep.on_lost.append(on_lost)

  # Ctrl-C sets a flag the loop reads between steps (a KeyboardInterrupt raised inside a step could land in
  # a callback that swallows it); a second Ctrl-C interrupts at once.
  interrupted = threading.Event()

  def on_sigint(*_):
    if interrupted.is_set():
      raise KeyboardInterrupt
    interrupted.set()

  previous = signal.signal(signal.SIGINT, on_sigint)
  previous_term = signal.signal(signal.SIGTERM, on_sigint)  # SIGTERM stops as Ctrl-C does
  start = time.perf_counter()
  failure = None
  try:
    while (engine.has_work() or not eof) and not interrupted.is_set():
      if engine.has_work():
        for req in engine.step():
          finished(req)
      write_ready()  # (before read_more: with nothing to decode, it waits for the next line)
      read_more()
    write_ready()
  except KeyboardInterrupt:
    interrupted.set()
  except _RunError as e:  # what finished is written, then one line
    failure = str(e)
  except Exception as e:  # noqa: BLE001 - a step that fails as a whole: what finished is written, then one line
    failure = f"a step failed ({type(e).__name__}: {e})"
    logging.exception("a step failed")  # the traceback, for a report
  finally:
    signal.signal(signal.SIGINT, previous)
    signal.signal(signal.SIGTERM, previous_term)
    engine.close()  # several processes: the followers stop too
    if dest not in (None, sys.stdout):
      try:
        dest.close()
      except OSError:  # (the write that failed is reported above; closing flushes it again)
        pass
  dumped = ""
  if dump is not None and (traces or (failure is None and not interrupted.is_set())):
    try:  # (on Ctrl-C or a failure too: the finished requests' traces)
      dumped = dump_traces()
    except OSError as e:
      failure = failure or f"--dump-topk {dump!r}: {e.strerror or e}"
  if failure is not None or interrupted.is_set():
    message = written_summary(dumped)
    if failure is not None:
      sys.exit(f"error: {failure}; {message}")
    print(f"\n[generate] interrupted: {message}", file=sys.stderr)
    sys.exit(130)
  if dest is None:  # a finished run with no result line (no prompts): the output is that, empty
    open(FLAGS.output, "w").close()
  elapsed = time.perf_counter() - start
  if dumped:
    print(f"[generate] {dumped}", file=sys.stderr)
  mode = f"hisparse, host pool: {engine.host_pool}" if hisparse else "dense"
  mode += engine.numerics_label()
  n = totals["requests"]
  print(
    f"[generate] {read} prompt line{'' if read == 1 else 's'}: {n} run, {read - n} rejected; "
    f"{totals['tokens']} new tokens in {elapsed:.2f} s ({mode}; includes compilation)",
    file=sys.stderr,
  )
  if engine.lockstep is not None:
    print(f"[generate] {engine.lockstep.summary(elapsed)}", file=sys.stderr)
  if hisparse is not None:
    hits, misses = totals["hits"], totals["misses"]
    prefetched = f", {totals['prefetched']} rows prefetched" if hisparse.prefetch != "none" else ""
    rate = f"{misses / (hits + misses):.3f}" if hits + misses else "n/a: no swap-in ran"
    print(f"[generate] swap-in: {hits} hits, {misses} misses (miss rate {rate}){prefetched}", file=sys.stderr)
    if hisparse.resident_fraction > 0:
      steps = engine.residency_steps
      print(
        f"[generate] dynamic residency: {engine.num_offloads} offloads; decode steps with every row resident "
        f"{steps['all']}, some {steps['mixed']}, none {steps['none']}",
        file=sys.stderr,
      )
  if engine.num_preemptions:
    print(
      f"[generate] {engine.num_preemptions} preemptions (KV freed and recomputed: raise --max-device-kv-bytes "
      "or lower --max-running-requests)",
      file=sys.stderr,
    )
  if read and not n:  # (a run with some lines rejected still did its work: exit status 0)
    sys.exit(f"error: every prompt line was rejected; {written_summary('')}")


if __name__ == "__main__":
  from hisparse_jax import cli

  try:
    cli.run(main)
  except KeyboardInterrupt:  # before the decode loop: nothing was written yet
    print("\n[generate] interrupted before any result was written", file=sys.stderr)
    sys.exit(130)
