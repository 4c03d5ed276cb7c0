r"""Command-line client for the hisparse-jax server: streams one request and prints it.

  python -m hisparse_jax.serving.client [--target 127.0.0.1:50051] (--text "..." | --text-file F | --input-ids 1,2,3) \
      [--max-new-tokens 32] [--request-id ID] [--print-ids] [--tls-ca-file ca.pem] \
      [--api-key KEY | --api-key-file FILE]
  python -m hisparse_jax.serving.client [--target ...] --loads        # the server's GetLoads, as JSON
  python -m hisparse_jax.serving.client [--target ...] --abort ID     # Abort: ends the requests with that id

Prints the text as it streams (``--print-ids``: then the output token ids too), then a summary line with the
finish reason and the swap-in hits/misses; the request's id (the server's unless ``--request-id``) goes to stderr
as the first message arrives. Exits 1 with the server's status on an RPC error.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time

import grpc
from absl import flags
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
from hisparse_jax.serving import credentials
from hisparse_jax.serving.addresses import MAX_TIMEOUT_S, check_timeout

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "127.0.0.1:50051", "Server address.")
flags.DEFINE_string("text", None, "Prompt text.")
flags.DEFINE_string(
  "text-file",
  None,
  "Read the prompt text from this file ('-': standard input), exactly as it is "
  "(UTF-8, at most 64 MiB): for prompts longer than a command line holds (~128 KB).",
)
flags.DEFINE_list("input-ids", None, "Prompt token ids, comma separated.")
flags.DEFINE_integer("max-new-tokens", 32, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
flags.DEFINE_float("top-p", 1.0, "Nucleus sampling mass (1: off).")
flags.DEFINE_integer("top-k", 0, "Sample among the k most likely tokens (0: off).")
flags.DEFINE_integer("seed", None, "Sampling seed in [0, 2**32) (default: random).")
flags.DEFINE_multi_string(
  "stop",
  [],
  "Stop once the output contains this string (sent as given: no escapes are "
  "read, so pass a newline as bash's $'\\n', not \"\\n\").",
)
flags.DEFINE_list("stop-token-ids", [], "Stop after any of these token ids.")
flags.DEFINE_boolean("include-stop-str-in-output", False, "Keep the matched stop string at the end of the text.")
flags.DEFINE_boolean("ignore-eos", False, "Keep generating past the model's EOS tokens.")
flags.DEFINE_float("timeout-s", 300.0, "RPC deadline in seconds (inf: none).")
flags.DEFINE_float("wait-for-ready-s", 0.0, "Wait up to this long for the server's health service to report SERVING.")
flags.DEFINE_string("tls-ca-file", None, "Connect with TLS, trusting this CA certificate (PEM).")
flags.DEFINE_string("tls-cert-file", None, "Client certificate (PEM) for a server that requires mutual TLS.")
flags.DEFINE_string("tls-key-file", None, "Private key (PEM) of --tls-cert-file.")
flags.DEFINE_string("api-key", None, "Bearer token the server requires (sent as 'authorization' metadata).")
flags.DEFINE_string("api-key-file", None, "File holding the bearer token (first line).")
flags.DEFINE_string("request-id", None, "The request's id (default: the server picks one; --abort takes it).")
flags.DEFINE_boolean(
  "print-ids",
  False,
  "After the text, print the output token ids (printed anyway when the "
  "server sends no text: a model without a tokenizer).",
)
flags.DEFINE_boolean(
  "loads", False, "Print the server's loads (GetLoads) as JSON (the .proto field names) and exit; no request."
)
flags.DEFINE_string("abort", None, "Abort the server's requests with this id, print how many, and exit.")


def open_channel(
  target: str, *, tls_ca: bytes | None = None, tls_cert: bytes | None = None, tls_key: bytes | None = None
) -> grpc.Channel:
  """A plain-text channel, or a TLS one when tls_ca (PEM bytes) is given (tls_cert/tls_key: mutual TLS)."""
  if tls_ca is None:
    return grpc.insecure_channel(target)
  return grpc.secure_channel(target, grpc.ssl_channel_credentials(tls_ca, tls_key, tls_cert))


def message_fields(message) -> dict:
  """A protobuf message as a dict keyed by its fields' proto names (GetLoads' ``free_lanes``, as the .proto
  and GetLoads' docs spell them), every field present, numbers as numbers (``json_format`` would write
  camelCase names and 64-bit integers as strings, by the proto3 JSON mapping) and enums by name."""
  out = {}
  for field in message.DESCRIPTOR.fields:
    value = getattr(message, field.name)
    if field.message_type is not None:
      value = [message_fields(v) for v in value] if field.is_repeated else message_fields(value)
    elif field.enum_type is not None:
      name = field.enum_type.values_by_number
      value = [name[v].name for v in value] if field.is_repeated else name[value].name
    elif field.is_repeated:
      value = list(value)
    out[field.name] = value
  return out


def auth_metadata(api_key: str | None) -> tuple:
  """gRPC call metadata carrying api_key as a bearer token (empty without a key)."""
  return (("authorization", credentials.bearer(api_key)),) if api_key else ()


def wait_for_serving(channel, timeout_s: float) -> None:
  """Polls grpc.health.v1 until SERVING; raises TimeoutError after timeout_s seconds."""
  stub = health_pb2_grpc.HealthStub(channel)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
        return
    except grpc.RpcError:
      pass
    if time.monotonic() > deadline:
      raise TimeoutError(f"server not SERVING after {timeout_s:.0f} s")
    time.sleep(0.2)


def generate(stub, *, text=None, input_ids=None, max_new_tokens=32, timeout=None, api_key=None, **sampling):
  """Yields the server's GenerateResponse messages for one request (the request_id is on the first).

  sampling: GenerateRequest fields (temperature, top_p, top_k, seed, stop, stop_token_ids,
    include_stop_str_in_output, ignore_eos, request_id). api_key: the server's bearer token, if it needs one.
  """
  req = hisparse_pb2.GenerateRequest(max_new_tokens=max_new_tokens, **sampling)
  if text is not None:
    req.text = text
  elif input_ids is not None:
    req.input_ids.ids.extend(input_ids)
  yield from stub.Generate(req, timeout=timeout, metadata=auth_metadata(api_key))


def summary_line(msg) -> str:
  """The client's last line for a request's final GenerateResponse: finish reason and token counts, then the
  swap-in counts (only when the request swapped rows in: a dense server, or a HiSparse request whose KV stayed
  on device, swaps nothing), prefetched rows, the matched stop and the preemptions when there are any, and a
  disaggregated request's timings (its prompt KV came from a prefill server: seconds to the first token there,
  of the KV transfer and of the decode here, and the bytes transferred)."""
  return (
    f"[client] finish={hisparse_pb2.FinishReason.Name(msg.finish_reason)} prompt_tokens={msg.prompt_tokens} "
    f"completion_tokens={msg.completion_tokens}"
    + (
      f" swap_in_hits={msg.swap_in_hits} swap_in_misses={msg.swap_in_misses}"
      if msg.swap_in_hits or msg.swap_in_misses
      else ""
    )
    + (f" swap_in_prefetched={msg.swap_in_prefetched}" if msg.swap_in_prefetched else "")
    + (f" matched_stop={_matched_stop(msg)}" if msg.matched_stop else "")
    + (f" num_preemptions={msg.num_preemptions}" if msg.num_preemptions else "")
    + (
      f" prefill_s={msg.prefill_seconds:.3f} transfer_s={msg.transfer_seconds:.3f} "
      f"transfer_bytes={msg.transfer_bytes} decode_s={msg.decode_seconds:.3f}"
      if msg.transfer_bytes
      else ""
    )
  )


def _matched_stop(msg) -> str:
  """A stop string quoted (it may hold spaces or newlines); a stop token's id as the number it is."""
  return repr(msg.matched_stop) if msg.finish_reason == hisparse_pb2.STOP_STRING else msg.matched_stop


INT32_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1  # the engine's range for a seed (Engine.validate), narrower than the field's uint64


def _ints(flag: str, values, low: int, high: int) -> list[int]:
  """--flag's comma-separated values as integers in [low, high] (the request field's range); ValueError naming
  the flag otherwise."""
  try:
    ints = [int(x) for x in values]
  except ValueError:
    raise ValueError(f"--{flag} must be integers") from None
  if bad := [x for x in ints if not low <= x <= high]:
    raise ValueError(f"--{flag} {bad[0]}: outside [{low}, {high}]")
  return ints


# --text-file's bound: a 163840-token context of DeepSeek-V3's longest tokens (128 bytes) is 21 MB.
MAX_TEXT_FILE_BYTES = 64 << 20


def read_text_file(path: str) -> str:
  """The text of --text-file: a regular file, a pipe, or standard input for "-", read whole (its bytes exactly,
  a final newline included) and decoded as UTF-8. ValueError naming the flag for a file that cannot be opened,
  a device (/dev/zero never ends), more than MAX_TEXT_FILE_BYTES, or bytes that are not UTF-8."""
  try:
    f = open(sys.stdin.fileno(), "rb", closefd=False) if path == "-" else open(path, "rb")
  except OSError as e:
    raise ValueError(f"--text-file {path!r}: {e.strerror}") from None
  with f:
    mode = os.fstat(f.fileno()).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (path == "-" and os.isatty(0))):
      raise ValueError(f"--text-file {path!r}: not a regular file or a pipe")
    try:
      data = f.read(MAX_TEXT_FILE_BYTES + 1)
    except OSError as e:
      raise ValueError(f"--text-file {path!r}: {e.strerror}") from None
  if len(data) > MAX_TEXT_FILE_BYTES:
    raise ValueError(f"--text-file {path!r}: more than {MAX_TEXT_FILE_BYTES} bytes")
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"--text-file {path!r}: not UTF-8 (byte {e.start})") from None


def _check_flags() -> tuple[list[int] | None, list[int]]:
  """(prompt ids or None, stop token ids); ValueError naming the flag for a value the request cannot carry."""
  if FLAGS.loads and FLAGS.abort is not None:
    raise ValueError("give at most one of --loads and --abort")
  prompts = [f for f in ("text", "text-file", "input-ids") if FLAGS[f].value is not None]
  if FLAGS.loads or FLAGS.abort is not None:
    if prompts:
      raise ValueError(f"--{'loads' if FLAGS.loads else 'abort'} sends no request: drop --{prompts[0]}")
  elif len(prompts) != 1:
    raise ValueError("give exactly one of --text, --text-file or --input-ids (or --loads, --abort ID)")
  ids = None if FLAGS["input-ids"].value is None else _ints("input-ids", FLAGS["input-ids"].value, 0, INT32_MAX)
  stop_token_ids = _ints("stop-token-ids", FLAGS["stop-token-ids"].value, 0, INT32_MAX)
  _ints("max-new-tokens", [FLAGS["max-new-tokens"].value], 1, INT32_MAX)
  _ints("top-k", [FLAGS["top-k"].value], 0, INT32_MAX)
  if FLAGS.seed is not None:
    _ints("seed", [FLAGS.seed], 0, SEED_MAX)
  check_timeout("--timeout-s", FLAGS["timeout-s"].value, allow_inf=True)
  if not 0 <= FLAGS["wait-for-ready-s"].value <= MAX_TIMEOUT_S:
    raise ValueError(
      f"--wait-for-ready-s must be in [0, {MAX_TIMEOUT_S:g}] seconds, got {FLAGS['wait-for-ready-s'].value}"
    )
  return ids, stop_token_ids


def _rpc_error(e: grpc.RpcError, tls: bool) -> str:
  """The one-line message of a failed call, with a hint where the cause is a common set-up mistake."""
  details = e.details() or ""
  text = f"{e.code().name}: {details}"
  if e.code() != grpc.StatusCode.UNAVAILABLE or details.startswith("prefill failed: "):
    return text  # (a decode server's words about its prefill server carry their own hints)
  if details == "Cancelling all calls":
    text += " (the server is shutting down)"
  elif "Stream removed" in details:  # the connection broke mid-call
    text += " (the connection was lost mid-call: did the server exit?)"
  elif "Socket closed" in details and not tls:  # closed as it connected
    text += " (a server with TLS closes a plain-text connection: pass --tls-ca-file)"
  return text


def main(argv):
  del argv
  try:
    ids, stop_token_ids = _check_flags()
    text = read_text_file(FLAGS["text-file"].value) if FLAGS["text-file"].value is not None else FLAGS.text
    tls = {k: credentials.read_file(f"tls-{k}-file", FLAGS[f"tls-{k}-file"].value) for k in ("ca", "cert", "key")}
    api_key = credentials.api_key(FLAGS["api-key"].value, FLAGS["api-key-file"].value)
    if (tls["cert"] is None) != (tls["key"] is None) or (tls["cert"] is not None and tls["ca"] is None):
      raise ValueError("mutual TLS needs --tls-cert-file and --tls-key-file together, with --tls-ca-file")
    credentials.check_pem(
      FLAGS["tls-cert-file"].value,
      FLAGS["tls-key-file"].value,
      FLAGS["tls-ca-file"].value,
      tls["cert"],
      tls["key"],
      tls["ca"],
      ca_flag="tls-ca-file",
    )
  except ValueError as e:
    sys.exit(f"error: {e}")
  timeout = None if FLAGS["timeout-s"].value == float("inf") else FLAGS["timeout-s"].value
  with open_channel(FLAGS.target, tls_ca=tls["ca"], tls_cert=tls["cert"], tls_key=tls["key"]) as channel:
    stub = hisparse_pb2_grpc.HiSparseInferenceStub(channel)
    if FLAGS["wait-for-ready-s"].value > 0:
      try:
        wait_for_serving(channel, FLAGS["wait-for-ready-s"].value)
      except TimeoutError as e:
        sys.exit(f"error: {FLAGS.target}: {e}")
    if FLAGS.loads or FLAGS.abort is not None:
      try:
        if FLAGS.loads:
          loads = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=timeout, metadata=auth_metadata(api_key))
          print(json.dumps(message_fields(loads), indent=2))
        else:
          r = stub.Abort(
            hisparse_pb2.AbortRequest(request_id=FLAGS.abort), timeout=timeout, metadata=auth_metadata(api_key)
          )
          print(f"[client] aborted {r.aborted} request{'' if r.aborted == 1 else 's'} with id {FLAGS.abort!r}")
      except grpc.RpcError as e:
        sys.exit(f"error: {_rpc_error(e, tls['ca'] is not None)}")
      return
    streamed, output_ids = False, []
    try:
      sampling = dict(
        temperature=FLAGS.temperature,
        top_p=FLAGS["top-p"].value,
        top_k=FLAGS["top-k"].value,
        stop=FLAGS.stop,
        stop_token_ids=stop_token_ids,
        include_stop_str_in_output=FLAGS["include-stop-str-in-output"].value,
        ignore_eos=FLAGS["ignore-eos"].value,
      )
      if FLAGS.seed is not None:
        sampling["seed"] = FLAGS.seed
      if FLAGS["request-id"].value is not None:
        sampling["request_id"] = FLAGS["request-id"].value
      for msg in generate(
        stub,
        text=text,
        input_ids=ids,
        max_new_tokens=FLAGS["max-new-tokens"].value,
        timeout=timeout,
        api_key=api_key,
        **sampling,
      ):
        if msg.request_id:  # (on the first message) where --abort ID from another terminal can find it
          print(f"[client] request id {msg.request_id}", file=sys.stderr, flush=True)
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        streamed = streamed or bool(msg.text)
        output_ids.extend(msg.token_ids)
        if msg.finished:
          if output_ids and (FLAGS["print-ids"].value or not streamed):  # (no tokenizer: ids, not text)
            print(("\n" if streamed else "") + f"output_ids={output_ids}", end="")
          print("\n" + summary_line(msg))
    except grpc.RpcError as e:
      sys.exit(("\n" if streamed else "") + f"error: {_rpc_error(e, tls['ca'] is not None)}")
    except ValueError as e:  # protobuf: an integer flag outside its field's range (int32 / uint64)
      sys.exit(f"error: {e} (a flag value outside the range of its request field)")


if __name__ == "__main__":
  from hisparse_jax import cli

  try:
    cli.run(main)
  except KeyboardInterrupt:  # Ctrl-C: the stream is cancelled as the channel closes (the server frees it)
    print("\n[client] interrupted", file=sys.stderr)
    sys.exit(130)
  except BrokenPipeError:  # stdout closed early (`... --loads | head -3`): stop quietly, as a shell tool does
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's own flush cannot fail too)
    sys.exit(141)  # 128 + SIGPIPE, the status a shell gives a tool a closed pipe stopped
