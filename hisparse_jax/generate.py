r"""Batch greedy decoding: a JSONL file of prompts in, a JSONL file of outputs out.

  python -m hisparse_jax.generate --prompts prompts.jsonl [--model-path DIR] \
      [--max-new-tokens 32] [--dtype float32|bfloat16] [--max-running-requests 64] \
      [--enable-hisparse [--hisparse-config '{"top_k": 32, "device_buffer_size": 64}'] \
      [--host-pool auto|jax|extension]] [--max-seq-len N] [--chunked-prefill-size 2048] \
      [--page-size 64] [--max-device-kv-bytes N] [--deterministic] [--kv-cache-dtype auto|fp8_e4m3] \
      [--output out.jsonl] [--dump-topk trace.npz]

Engine flags are ``hisparse_jax.engine.args.EngineArgs`` (shared with the server; ``--helpfull`` lists them).

Input lines: ``{"text": "..."}`` or ``{"input_ids": [...]}``, optionally with
``"max_new_tokens"``. Output: one line per non-blank input line, in input order, each written (and
flushed) as soon as it and every line before it are done, so an interrupted run keeps what it finished;
Ctrl-C (or SIGTERM) exits with status 130 and a one-line message. ``--output`` and ``--dump-topk`` may be neither
the prompts file, nor each other, nor inside the model directory (start-up errors). Lines have
``output_ids`` (new tokens only), ``text`` (when the model has a tokenizer),
``finish_reason``, ``prompt_tokens``, ``hits``/``misses`` (swap-in counts, HiSparse only), ``prefetched`` (rows
the cross-layer prefetch copied, with ``"prefetch": "next_layer"``) — or
``{"error": ..., "code": ...}`` for a line that cannot be served (finish_reason ``"error"`` with an
``error`` message when a kernel refused the request's row mid-run); the others are decoded anyway. All requests run through one continuous-batching engine.

``--dump-topk FILE.npz`` records the indexer's top-k positions at every decode
step of every layer: for input line N, ``topk_N`` int32[steps, layers, index_topk]
(-1 = padding, step t attends at seq_len = prompt_tokens + t + 1) and
``prompt_tokens_N`` (int). ``benchmarks/miss_rate.py --trace FILE.npz`` replays it.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import tempfile
import threading
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("prompts", None, "JSONL file of prompts.", required=True)
flags.DEFINE_string("output", None, "JSONL output file (default: stdout).")
flags.DEFINE_integer("max-new-tokens", 32, "Tokens to generate per prompt unless the line says otherwise.")
flags.DEFINE_string("dump-topk", None, "Write every request's per-step, per-layer top-k positions to this .npz "
                    "(keys topk_<line>, prompt_tokens_<line>) for benchmarks/miss_rate.py --trace.")


MAX_NEW_TOKENS = 2**31 - 1  # token counts are int32 on the device; a line's own value is checked against the context


def _define_engine_flags():
  from hisparse_jax.distributed import DistributedArgs
  from hisparse_jax.engine.args import EngineArgs
  EngineArgs.define_flags()
  DistributedArgs.define_flags()


_define_engine_flags()


def _parse_line(line: str, lineno: int, tokenizer, bos: int | None, default_max_new: int, max_prompt_bytes: int):
  """Returns (prompt_ids, max_new_tokens); raises ValueError with a message for a bad line (a ``text`` over
  ``max_prompt_bytes`` UTF-8 bytes is refused before it is tokenized, as the server does)."""
  try:
    line.encode("utf-8")
  except UnicodeEncodeError:
    raise ValueError(f"line {lineno}: not valid UTF-8") from None
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"line {lineno}: not JSON: {e}") from None
  if not isinstance(obj, dict):
    raise ValueError(f"line {lineno}: expected a JSON object")
  unknown = set(obj) - {"text", "input_ids", "max_new_tokens"}
  if unknown:
    raise ValueError(f"line {lineno}: unknown field(s) {sorted(unknown)}")
  if ("text" in obj) == ("input_ids" in obj):
    raise ValueError(f"line {lineno}: give exactly one of 'text' or 'input_ids'")
  max_new = obj.get("max_new_tokens", default_max_new)
  if isinstance(max_new, bool) or not isinstance(max_new, int):
    raise ValueError(f"line {lineno}: max_new_tokens must be an integer")
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
    return encode_prompt(tokenizer, obj["text"], bos), max_new
  ids = obj["input_ids"]
  if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
    raise ValueError(f"line {lineno}: 'input_ids' must be a list of integers")
  return ids, max_new


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
  return os.path.realpath(a) == os.path.realpath(b) or (os.path.exists(a) and os.path.exists(b)
                                                        and os.path.samefile(a, b))


def read_prompt_lines(path: str, limit: int) -> list[str]:
  """The lines of the prompts file at ``path`` (split on \\n only: JSON strings may hold U+2028; a trailing \\r
  dropped; bytes that are not UTF-8 kept as surrogates, so such a line fails alone in _parse_line). ``path`` may
  be a file, a pipe or FIFO, a terminal or /dev/null; StartupError for another device (/dev/zero, /dev/urandom
  never end), for more than ``limit`` bytes (a pipe may never end either; the script passes 1/8 of physical
  memory, as the lines take ~3x their bytes), or when it cannot be read."""
  from hisparse_jax.engine.args import StartupError
  try:
    with open(path, "rb") as f:
      st = os.fstat(f.fileno())
      if stat.S_ISCHR(st.st_mode) and not os.isatty(f.fileno()) and st.st_rdev != os.stat(os.devnull).st_rdev:
        raise StartupError(f"--prompts {path!r} is a device, not a file, pipe, terminal or /dev/null")
      data = f.read(limit + 1)
      if len(data) > limit:
        raise StartupError(f"--prompts {path!r} holds more than {limit} bytes (1/8 of this machine's memory); "
                           "split it into several runs")
  except OSError as e:
    raise StartupError(f"--prompts {path!r}: {e}") from None
  return [x.rstrip("\r") for x in data.decode("utf-8", "surrogateescape").split("\n")]


def _read_prompts_and_check_outputs(dump: str | None, model_dir: str) -> list[str]:
  """The prompt file's lines; StartupError (before the model loads) for an unreadable --prompts, or an --output /
  --dump-topk that cannot be written or would overwrite an input: the prompts file, the other output, or anything
  in the --model-path directory."""
  from hisparse_jax.engine.args import StartupError
  lines = read_prompt_lines(FLAGS.prompts, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8)
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
    if _same_file(path, FLAGS.prompts):
      raise StartupError(f"{flag} {path!r} is the --prompts file; writing it would destroy the prompts")
    if os.path.commonpath([model_root, os.path.realpath(path)]) == model_root:
      raise StartupError(f"{flag} {path!r} is inside the --model-path directory {model_dir}; write it elsewhere")
    for other_flag, other in outputs[:i]:
      if _same_file(path, other):
        raise StartupError(f"{flag} {path!r} is the {other_flag} file; give them different names")
    _check_writable_dir(flag, path)
  return lines


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
  print(f"[generate] process {jax.process_index()} of {jax.process_count()}: followed process 0 for {steps} steps",
        file=sys.stderr)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from hisparse_jax import distributed
  from hisparse_jax.engine.args import EngineArgs, StartupError, load_tokenizer_or_fail
  dist = distributed.DistributedArgs.from_flags()
  try:
    args = EngineArgs.from_flags()
    args.validate()
    if not 1 <= FLAGS["max-new-tokens"].value <= MAX_NEW_TOKENS:
      raise StartupError(f"--max-new-tokens must be 1..{MAX_NEW_TOKENS}, got {FLAGS['max-new-tokens'].value}")
    distributed.initialize(dist)
    dump = FLAGS["dump-topk"].value
    lines, error = None, None
    try:  # every process checks its model; process 0 alone reads the prompts and writes the results
      model_dir = args.model_dir()
      model_cfg = args.model_config(model_dir)
      tokenizer = load_tokenizer_or_fail(model_dir)
      if dist.process_id == 0:
        lines = _read_prompts_and_check_outputs(dump, model_dir)
    except StartupError as e:
      error = str(e)
    distributed.startup_barrier(error)  # every process stops when one's checks fail, with its message
    if dist.process_id > 0:
      if FLAGS.output:
        print(f"[generate] process {dist.process_id}: --output {FLAGS.output!r} is not written here: process 0 "
              "writes the results", file=sys.stderr)
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

  # Blank lines are skipped; numbers in messages are the file's own line numbers.
  numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
  results: list[dict] = [{} for _ in numbered]
  requests: list[tuple[int, Request]] = []
  for i, (lineno, line) in enumerate(numbered):
    try:
      ids, max_new = _parse_line(line, lineno, tokenizer, model_cfg.bos_token_id, FLAGS["max-new-tokens"].value,
                                 engine.max_prompt_bytes)
      req = Request(request_id=str(lineno), prompt_ids=ids, max_new_tokens=max_new)
      engine.submit(req)
      requests.append((i, req))
    except RequestError as e:
      results[i] = {"error": f"line {lineno}: {e}", "code": e.code}
    except Exception as e:  # noqa: BLE001 - one bad line must not sink the batch
      msg = str(e) if str(e).startswith(f"line {lineno}:") else f"line {lineno}: {type(e).__name__}: {e}"
      results[i] = {"error": msg, "code": "INVALID_ARGUMENT"}

  index = {req.request_id: i for i, req in requests}
  written = 0
  dest = None if FLAGS.output else sys.stdout  # opened at the first result: a run that fails before keeps the file

  def write_ready() -> None:  # the finished prefix of the results, in input order
    nonlocal written, dest
    while written < len(results) and results[written]:
      if dest is None:
        dest = open(FLAGS.output, "w", encoding="utf-8")
      dest.write(json.dumps(results[written], ensure_ascii=False) + "\n")
      written += 1
    if dest is not None:
      dest.flush()

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
    write_ready()  # lines rejected up front
    while engine.has_work() and not interrupted.is_set():
      for req in engine.step():
        out = {"output_ids": req.output_ids, "finish_reason": req.finish_reason,
               "prompt_tokens": len(req.prompt_ids)}
        if req.finish_reason == "error":  # a kernel refused this request's row; the others went on
          out["error"] = req.error
        if tokenizer is not None:
          out["text"] = req.text
        if hisparse is not None:
          out["hits"], out["misses"] = req.hits, req.misses
          if hisparse.prefetch != "none":
            out["prefetched"] = req.prefetched
        results[index[req.request_id]] = out
      write_ready()
  except KeyboardInterrupt:
    interrupted.set()
  except Exception as e:  # noqa: BLE001 - a step that fails as a whole: what finished is written, then one line
    failure = f"{type(e).__name__}: {e}"
    logging.exception("a step failed")  # the traceback, for a report
  finally:
    signal.signal(signal.SIGINT, previous)
    signal.signal(signal.SIGTERM, previous_term)
    engine.close()  # several processes: the followers stop too
    if dest not in (None, sys.stdout):
      dest.close()
  if failure is not None:
    where = FLAGS.output or "stdout"
    sys.exit(f"error: a step failed ({failure}); {written} of {len(results)} results written to {where}"
             + (f" (the earlier {where} is unchanged)" if output_existed and not written else ""))
  if interrupted.is_set():
    where = FLAGS.output or "stdout"
    print(f"\n[generate] interrupted: {written} of {len(results)} results written to {where}"
          + (f" (the earlier {where} is unchanged)" if output_existed and not written else ""), file=sys.stderr)
    sys.exit(130)
  if dest is None:  # a finished run with no result line (no prompts): the output is that, empty
    open(FLAGS.output, "w").close()
  elapsed = time.perf_counter() - start
  if dump is not None:
    import numpy as np
    L, K = model_cfg.num_hidden_layers, model_cfg.index_topk
    arrays = {}
    for i, req in requests:
      lineno = numbered[i][0]
      steps = np.stack(req.topk_trace) if req.topk_trace else np.zeros((0, L, K), np.int32)
      arrays[f"topk_{lineno}"] = steps.astype(np.int32)
      arrays[f"prompt_tokens_{lineno}"] = np.int64(len(req.prompt_ids))
    # Written next to the target, then renamed: an existing trace is replaced whole or not at all.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dump)), suffix=".npz")
    try:
      with os.fdopen(fd, "wb") as f:
        np.savez_compressed(f, **arrays)
      os.replace(tmp, dump)
    except BaseException:
      os.unlink(tmp)
      raise
    print(f"[generate] top-k trace of {len(requests)} requests written to {dump}", file=sys.stderr)
  n_tokens = sum(len(r.output_ids) for _, r in requests)
  mode = f"hisparse, host pool: {engine.host_pool}" if hisparse else "dense"
  mode += engine.numerics_label()
  print(f"[generate] {len(requests)} request{'' if len(requests) == 1 else 's'} ({len(numbered) - len(requests)} rejected), {n_tokens} new tokens "
        f"in {elapsed:.2f} s ({mode}; includes compilation)", file=sys.stderr)
  if engine.lockstep is not None:
    print(f"[generate] {engine.lockstep.summary(elapsed)}", file=sys.stderr)
  if hisparse is not None:
    hits = sum(r.hits for _, r in requests)
    misses = sum(r.misses for _, r in requests)
    prefetched = (f", {sum(r.prefetched for _, r in requests)} rows prefetched"
                  if hisparse.prefetch != "none" else "")
    rate = f"{misses / (hits + misses):.3f}" if hits + misses else "n/a: no swap-in ran"
    print(f"[generate] swap-in: {hits} hits, {misses} misses (miss rate {rate}){prefetched}", file=sys.stderr)
    if hisparse.resident_fraction > 0:
      steps = engine.residency_steps
      print(f"[generate] dynamic residency: {engine.num_offloads} offloads; decode steps with every row resident "
            f"{steps['all']}, some {steps['mixed']}, none {steps['none']}", file=sys.stderr)
  if engine.num_preemptions:
    print(f"[generate] {engine.num_preemptions} preemptions (KV freed and recomputed: raise --max-device-kv-bytes "
          "or lower --max-running-requests)", file=sys.stderr)


if __name__ == "__main__":
  try:
    app.run(main)
  except KeyboardInterrupt:  # before the decode loop: nothing was written yet
    print("\n[generate] interrupted before any result was written", file=sys.stderr)
    sys.exit(130)
