r"""Starts the hisparse-jax gRPC inference server.

  python run_server.py [--model-path DIR] [--host 127.0.0.1] [--port 50051] \
      [--enable-hisparse [--hisparse-config JSON] [--host-pool auto|jax|extension]] \
      [--max-running-requests 64] [--max-seq-len N] [--chunked-prefill-size 2048] [--page-size 64] \
      [--max-device-kv-bytes N | --mem-fraction-static F] [--deterministic] [--dtype ...] \
      [--max-queued-requests 1024] [--max-prompt-bytes N] [--max-admission-skips 16] [--max-streams-per-client N] \
      [--[no]fair-sharing] [--max-connections N] [--handshake-timeout-s 10] \
      [--tls-cert-file cert.pem --tls-key-file key.pem [--tls-client-ca-file ca.pem]] \
      [--api-key KEY | --api-key-file FILE] [--client-keys-file FILE] [--operator-key-file FILE] \
      [--shutdown-grace-s 5] [--metrics-port P [--metrics-host 127.0.0.1]] \
      [--disaggregation-mode null|prefill|decode [--prefill-servers H:P,...] [--transfer-host 127.0.0.1] \
       [--transfer-port 0] [--transfer-timeout-s 60] [--prefill-timeout-s 600] [--max-offered-kv-bytes N] \
       [--[no]isolate-kv-pulls] [--prefill-tls-ca-file ca.pem [--prefill-tls-cert-file c.pem \
       --prefill-tls-key-file k.pem]]] \
      [--coordinator-address H:P --num-processes N --process-id I]

Engine flags are ``hisparse_jax.engine.args.EngineArgs`` (shared with the batch script; ``--help`` lists them).

Serves ``hisparse.HiSparseInference/Generate`` (server streaming), ``Abort``, ``GetLoads`` and
``grpc.health.v1.Health`` (which needs no API key, as load balancers expect); with ``--disaggregation-mode
prefill`` also ``hisparse.PrefillService`` (prompts' KV for decode servers: hisparse_jax/serving/disaggregation.py).
Generate streams beyond --max-running-requests + --max-queued-requests get RESOURCE_EXHAUSTED at once, as do a
client's beyond --max-streams-per-client. Binding a non-loopback address without TLS or an API key prints a
warning. Stops cleanly on SIGINT/SIGTERM: in-flight streams get --shutdown-grace-s, the engine loop then stops
after its current step; a shutdown step that overruns its bound is reported and the process exits anyway
(status 1). ``kill -USR1 PID`` prints every thread's stack to stderr.
"""

from __future__ import annotations

import faulthandler
import ipaddress
import os
import signal
import sys
import time

from absl import flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
flags.DEFINE_integer("port", 50051, "Port to bind (0: pick a free one; the chosen port is printed).")
flags.DEFINE_float(
  "shutdown-grace-s",
  5.0,
  "Seconds in-flight RPCs get to finish on SIGTERM; streams still open then end with UNAVAILABLE.",
)
flags.DEFINE_integer(
  "metrics-port",
  None,
  "Serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: a free port; the chosen one is printed).",
)
flags.DEFINE_string("metrics-host", "127.0.0.1", "Address the metrics endpoint binds (loopback by default).")
flags.DEFINE_integer(
  "max-streams-per-client",
  None,
  "Generate streams one client may hold open at once (more get "
  "RESOURCE_EXHAUSTED at once): a client is the name of its --client-keys-file key, else its TLS "
  "client certificate's common name under "
  "mutual TLS, else its IP address (IPv6: its /64 network; clients behind one proxy or NAT "
  "count as one). Default: half of --max-running-requests + --max-queued-requests with "
  "--fair-sharing, else no per-client bound.",
  lower_bound=1,
)
flags.DEFINE_bool(
  "fair-sharing",
  True,
  "Clients (as --max-streams-per-client counts them) take turns: each "
  "client's requests queue in arrival order, clients' in start-time fair order, and a client "
  "holding no request slot gets one at the next step, preempting the newest request of the client "
  "holding the most. --nofair-sharing: one arrival order for all (a single-tenant deployment).",
)
flags.DEFINE_integer(
  "max-connections",
  None,
  "TCP connections the gRPC server holds at once; more are closed as "
  "they arrive, so a flood of connections cannot take the process's descriptors (its soft "
  "descriptor limit is raised to the hard one at start). At most the descriptors beyond 1024; "
  "default: half of those, at most 16384.",
  lower_bound=1,
)
flags.DEFINE_float(
  "handshake-timeout-s",
  10.0,
  "Seconds a connection may take to finish its TLS handshake before it is closed (gRPC's default is 120 s).",
)
flags.DEFINE_string("tls-cert-file", None, "Serve TLS with this certificate chain (PEM); needs --tls-key-file.")
flags.DEFINE_string("tls-key-file", None, "Private key (PEM) of --tls-cert-file.")
flags.DEFINE_string("tls-client-ca-file", None, "Require client certificates signed by this CA (mutual TLS).")
flags.DEFINE_string(
  "api-key",
  None,
  "Bearer token every inference call must carry ('authorization: Bearer "
  "KEY' metadata); wrong or missing: UNAUTHENTICATED. Health needs none.",
)
flags.DEFINE_string("api-key-file", None, "File whose first line is the API key (keeps it out of `ps`).")
flags.DEFINE_string(
  "client-keys-file",
  None,
  "Per-client API keys, one 'NAME KEY' a line: a call with one is "
  "client NAME for --max-streams-per-client, --fair-sharing and the scope of its Aborts (callers "
  "of --api-key are told apart by certificate or address). Accepted beside --api-key.",
)
flags.DEFINE_string(
  "operator-key-file",
  None,
  "File whose first line is the operator's API key: accepted for "
  "every call, and its Abort reaches every client's requests of that id.",
)
flags.DEFINE_enum(
  "disaggregation-mode",
  "null",
  ["null", "prefill", "decode"],
  "Prefill/decode disaggregation: null = prefill and decode here (colocated); prefill = also serve "
  "PrefillService (prompts' KV for decode servers); decode = get every prompt's KV from "
  "--prefill-servers (required there). Prefill and decode servers need the same --model-path, "
  "--dtype, --kv-cache-dtype and --fp8-numerics, and a prefill server's --max-seq-len at least "
  "the decode server's (checked at the decode server's start).",
)
flags.DEFINE_list(
  "prefill-servers",
  [],
  "Decode mode (required there): host:port of the prefill servers' gRPC "
  "endpoints (round-robin; a failed prefill is retried once on the next).",
)
flags.DEFINE_string(
  "transfer-host",
  "127.0.0.1",
  "Address this server's KV transfer server binds and announces (jax.experimental.transfer; prefill and decode modes).",
)
flags.DEFINE_integer(
  "transfer-port",
  0,
  "The KV transfer server's TCP port (0: any free one); the bulk data "
  "moves over connections on ports the system picks (prefill and decode modes).",
)
flags.DEFINE_float(
  "transfer-timeout-s",
  60.0,
  "Decode: the longest a prompt KV pull may take; prefill: how long "
  "an offered KV waits to be pulled before it is taken back.",
)
flags.DEFINE_integer(
  "max-offered-kv-bytes",
  0,
  "Prefill: the most prompt KV bytes held for decode servers at "
  "once (offers not pulled yet, prefills in flight; copies outside the KV pools); a prompt "
  "whose offer would pass it gets RESOURCE_EXHAUSTED before it is prefilled. Taken from the "
  "device KV budget, whose rest sizes the KV pools. 0: half of the budget. Per DP group "
  "(--dp-size): each group's offers stay on its first device.",
)
flags.DEFINE_bool(
  "isolate-kv-pulls",
  True,
  "Decode: pull prompt KV in a worker process, so that a peer whose "
  "transfer bytes crash jax's transfer library ends that pull, not this server "
  "(hisparse_jax/serving/pull_worker.py; costs one host copy per pull). --noisolate-kv-pulls "
  "pulls in this process: for links only the deployment's own servers can reach.",
)
flags.DEFINE_string(
  "prefill-tls-ca-file",
  None,
  "Decode: connect to the prefill servers with TLS, trusting this "
  "CA certificate (PEM); they serve TLS with their --tls-cert-file. Without it the links are "
  "plain text (a warning unless every prefill server is on loopback).",
)
flags.DEFINE_string(
  "prefill-tls-cert-file",
  None,
  "Decode: this server's certificate (PEM) for prefill servers that "
  "require mutual TLS (their --tls-client-ca-file); needs --prefill-tls-key-file.",
)
flags.DEFINE_string("prefill-tls-key-file", None, "Private key (PEM) of --prefill-tls-cert-file.")
flags.DEFINE_float(
  "prefill-timeout-s",
  600.0,
  "Decode: the longest a prefill server may take to offer a prompt's "
  "KV, its queue wait included; past it the attempt fails and is retried once on the next "
  "prefill server.",
)


MAX_SHUTDOWN_GRACE_S = 3600.0


def _define_engine_flags():
  from hisparse_jax import distributed
  from hisparse_jax.engine import args

  args.EngineArgs.define_flags(max_queued_requests=1024)
  distributed.DistributedArgs.define_flags()
  for module in (args, distributed):  # --help lists them with this program's own flags
    flags.adopt_module_key_flags(module)


_define_engine_flags()


def _is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def _security():
  """(TLSConfig or None, ApiKeys) from the flags; StartupError naming the flag at fault."""
  from hisparse_jax.engine.args import StartupError
  from hisparse_jax.serving import credentials
  from hisparse_jax.serving.server import ApiKeys, TLSConfig

  try:
    cert = credentials.read_file("tls-cert-file", FLAGS["tls-cert-file"].value)
    key = credentials.read_file("tls-key-file", FLAGS["tls-key-file"].value)
    ca = credentials.read_file("tls-client-ca-file", FLAGS["tls-client-ca-file"].value)
    keys = ApiKeys(
      shared=credentials.api_key(FLAGS["api-key"].value, FLAGS["api-key-file"].value),
      clients=credentials.client_keys(FLAGS["client-keys-file"].value),
      operator=credentials.api_key(None, FLAGS["operator-key-file"].value, "operator-key-file"),
    )
    every = [k for k in (keys.shared, keys.operator, *keys.clients.values()) if k is not None]
    if len(set(every)) != len(every):
      raise ValueError("--api-key, --client-keys-file and --operator-key-file must hold different keys")
  except ValueError as e:
    raise StartupError(str(e)) from None
  if (cert is None) != (key is None):
    raise StartupError("--tls-cert-file and --tls-key-file go together")
  if ca is not None and cert is None:
    raise StartupError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
  try:
    credentials.check_pem(
      FLAGS["tls-cert-file"].value, FLAGS["tls-key-file"].value, FLAGS["tls-client-ca-file"].value, cert, key, ca
    )
  except ValueError as e:
    raise StartupError(str(e)) from None
  return (TLSConfig(cert, key, ca) if cert is not None else None), keys


def _prefill_tls() -> tuple[bytes | None, bytes | None, bytes | None]:
  """(CA, certificate, key) PEM bytes of --prefill-tls-ca-file / -cert-file / -key-file; StartupError naming the
  flag for a file that cannot be read or parsed."""
  from hisparse_jax.engine.args import StartupError
  from hisparse_jax.serving import credentials

  names = ("prefill-tls-ca-file", "prefill-tls-cert-file", "prefill-tls-key-file")
  try:
    ca, cert, key = (credentials.read_file(name, FLAGS[name].value) for name in names)
    credentials.check_pem(
      FLAGS[names[1]].value,
      FLAGS[names[2]].value,
      FLAGS[names[0]].value,
      cert,
      key,
      ca,
      cert_flag=names[1],
      key_flag=names[2],
      ca_flag=names[0],
    )
  except ValueError as e:
    raise StartupError(str(e)) from None
  return ca, cert, key


def _check_addresses(metrics_port: int | None, disagg) -> None:
  """StartupError naming the flag unless --host:--port and --metrics-host:--metrics-port can be bound now, and
  none of them is another's or the KV transfer server's (--transfer-port)."""
  from hisparse_jax.engine.args import StartupError
  from hisparse_jax.serving.addresses import check_bindable, same_port

  try:
    check_bindable("--host/--port", FLAGS.host, FLAGS.port)
    if metrics_port is not None:
      metrics_host = FLAGS["metrics-host"].value
      if same_port(FLAGS.host, FLAGS.port, metrics_host, metrics_port):
        raise ValueError(f"--metrics-port {metrics_port} is --port {FLAGS.port}: give them different ports")
      check_bindable("--metrics-host/--metrics-port", metrics_host, metrics_port)
    if disagg.mode != "null":
      for port in disagg.transfer_ports():
        for flag, host, theirs in (
          ("--port", FLAGS.host, FLAGS.port),
          ("--metrics-port", FLAGS["metrics-host"].value, metrics_port or 0),
        ):
          if same_port(disagg.transfer_host, port, host, theirs):
            raise ValueError(f"--transfer-port {disagg.transfer_port} is {flag} {theirs}: give them different ports")
  except ValueError as e:
    raise StartupError(str(e)) from None


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from hisparse_jax import distributed
  from hisparse_jax.engine.args import EngineArgs, StartupError, load_tokenizer_or_fail, reserve_device_memory

  dist = distributed.DistributedArgs.from_flags()
  try:
    reserve_device_memory()  # (before JAX starts its GPU client; a bad value in the environment is refused)
    if not 0 <= FLAGS.port <= 65535:
      raise StartupError(f"--port {FLAGS.port}: expected 0..65535")
    if not 0 <= FLAGS["shutdown-grace-s"].value <= MAX_SHUTDOWN_GRACE_S:  # NaN fails too
      raise StartupError(
        f"--shutdown-grace-s must be in [0, {MAX_SHUTDOWN_GRACE_S}] seconds, got {FLAGS['shutdown-grace-s'].value}"
      )
    metrics_port = FLAGS["metrics-port"].value
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
      raise StartupError(f"--metrics-port {metrics_port}: expected 0..65535")
    tls, keys = _security()
    from hisparse_jax.serving.server import ServerLimits, raise_descriptor_limit

    raise_descriptor_limit()  # (before --max-connections is checked against it)
    try:
      limits = ServerLimits(
        max_streams_per_client=FLAGS["max-streams-per-client"].value,
        max_connections=FLAGS["max-connections"].value,
        handshake_timeout_s=FLAGS["handshake-timeout-s"].value,
        fair_sharing=FLAGS["fair-sharing"].value,
      )
    except ValueError as e:
      raise StartupError(
        str(e)
        .replace("ServerLimits.handshake_timeout_s", "--handshake-timeout-s")
        .replace("ServerLimits.max_connections", "--max-connections")
      ) from None
    if FLAGS["isolate-kv-pulls"].present and FLAGS["disaggregation-mode"].value != "decode":
      raise StartupError(
        f"--[no]isolate-kv-pulls is for --disaggregation-mode decode (got {FLAGS['disaggregation-mode'].value})"
      )
    from hisparse_jax.serving.disaggregation import DisaggregationConfig

    disagg = DisaggregationConfig(
      FLAGS["disaggregation-mode"].value,
      tuple(FLAGS["prefill-servers"].value),
      FLAGS["transfer-host"].value,
      FLAGS["transfer-timeout-s"].value,
      keys.shared,
      FLAGS["transfer-port"].value,
      FLAGS["prefill-timeout-s"].value,
      FLAGS["max-offered-kv-bytes"].value,
      FLAGS["isolate-kv-pulls"].value,
      *_prefill_tls(),
    )
    try:
      disagg.validate()
    except ValueError as e:
      raise StartupError(str(e)) from None
    if disagg.mode == "prefill" and dist.num_processes > 1:
      raise StartupError("--disaggregation-mode prefill runs on one process (--num-processes 1)")
    args = EngineArgs.from_flags()
    args.validate()
    distributed.initialize(dist)
    error = None
    try:  # every process checks its model; process 0, which binds, its ports (before the model loads)
      model_dir = args.model_dir()
      args.model_config(model_dir)
      tokenizer = load_tokenizer_or_fail(model_dir)
      if dist.process_id == 0:
        _check_addresses(metrics_port, disagg)
    except StartupError as e:
      error = str(e)
    distributed.startup_barrier(error)  # every process stops when one's checks fail, with its message
    from hisparse_jax.engine import Engine

    engine = Engine(
      args, tokenizer=tokenizer, offer_kv_bytes=disagg.max_offered_kv_bytes if disagg.mode == "prefill" else None
    )
  except StartupError as e:
    distributed.exit_with_error(f"error: {e}")
  if dist.process_id > 0:  # a follower: process 0 serves gRPC; this one takes the same steps
    import jax

    print(
      f"[server] process {jax.process_index()} of {jax.process_count()} following process 0 (model {model_dir})",
      flush=True,
    )
    try:
      steps = engine.follow()
    except distributed.DistributedError as e:  # process 0 stopped on an error of its own
      sys.exit(f"error: process 0: {e}")
    print(f"[server] process {jax.process_index()}: process 0 stopped after {steps} steps; stopped", flush=True)
    return

  from hisparse_jax.serving.addresses import join_host_port
  from hisparse_jax.serving.metrics import ServerMetrics
  from hisparse_jax.serving.server import serve

  plain = [s for s in disagg.prefill_servers if not _is_loopback(s.rpartition(":")[0])]
  if plain and disagg.prefill_tls_ca is None:
    print(
      f"[server] warning: plain-text links to prefill servers {', '.join(plain)}: anyone on that network can "
      "read the prompts and pose as them (use --prefill-tls-ca-file)",
      file=sys.stderr,
      flush=True,
    )
  if not _is_loopback(FLAGS.host) and tls is None and not keys:
    print(
      f"[server] warning: serving plain-text gRPC without authentication on {FLAGS.host}; anyone who can "
      "reach it can use and abort requests (use --tls-cert-file/--tls-key-file and --api-key-file)",
      file=sys.stderr,
      flush=True,
    )
  metrics = ServerMetrics(
    row_bytes=engine.layout.row_bytes, num_layers=engine.config.num_hidden_layers, disaggregation_mode=disagg.mode
  )
  metrics_at = ""
  if metrics_port is not None:
    host = FLAGS["metrics-host"].value
    if not _is_loopback(host):
      print(
        f"[server] warning: the metrics endpoint on {host} has no authentication; anyone who can reach it "
        "can read the server's load (bind it to a private address, or firewall it)",
        file=sys.stderr,
        flush=True,
      )
    import prometheus_client

    prometheus_client.disable_created_metrics()  # (no *_created series beside every counter and histogram)
    try:
      bound = metrics.serve(metrics_port, host)
    except OSError as e:
      message = f"--metrics-host/--metrics-port {host}:{metrics_port}: {e}"
      engine.close(error=message)  # several processes: the followers stop too, with the same message
      sys.exit(f"error: {message}")
    metrics_at = f", metrics at http://{join_host_port(host, bound)}/metrics"
  try:
    server, loop, port = serve(
      engine,
      tokenizer,
      FLAGS.host,
      FLAGS.port,
      metrics=metrics,
      tls=tls,
      api_key=keys,
      disaggregation=disagg,
      limits=limits,
    )
  except (OSError, ValueError) as e:  # a port it cannot bind; a prefill server that cannot serve this decode server
    message = f"--host/--port: {e}" if isinstance(e, OSError) else str(e)
    engine.close(error=message)
    sys.exit(f"error: {message}")
  mode = f"hisparse {engine.hisparse}, host pool: {engine.host_pool}" if engine.hisparse else "dense"
  mode += engine.numerics_label()
  if disagg.mode == "prefill":
    mode += "; prefill server"
  elif disagg.mode == "decode":
    mode += f"; decode server, prefill servers {','.join(disagg.prefill_servers)}"
  security = (
    ", ".join(
      x
      for x in (
        "" if tls is None else "mutual TLS" if tls.client_ca else "TLS",
        "API key" if keys.shared else "",
        f"{len(keys.clients)} client keys" if keys.clients else "",
        "operator key" if keys.operator else "",
      )
      if x
    )
    or "plain text, no API key"
  )
  print(
    f"[server] listening on {join_host_port(FLAGS.host, port)} ({mode}, model {model_dir}; {security}){metrics_at}",
    flush=True,
  )
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  # The handler only appends (an Event.set() there can deadlock on the Event's lock, which the interrupted main
  # thread may hold); the timed poll lets it run even if the signal was delivered to another thread.
  signals: list[int] = []
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda signum, _: signals.append(signum))
  while not signals:
    time.sleep(0.25)
  grace = FLAGS["shutdown-grace-s"].value
  streams = server.servicer.open_streams
  print(
    "[server] shutting down"
    + (
      f": {streams} stream{'s' if streams != 1 else ''} open, given --shutdown-grace-s "
      f"{grace:g} to finish, then cut (UNAVAILABLE)"
      if streams
      else ""
    ),
    flush=True,
  )
  grpc_stopped = server.stop(grace).wait(grace + 15)
  loop.stop(timeout=grace + 30)
  if not grpc_stopped or loop.is_alive():
    # Interpreter exit with a thread still inside gRPC or XLA can hang or abort: leave at once instead.
    print(
      "[server] warning: "
      + ("the gRPC server" if not grpc_stopped else "the engine loop")
      + " did not stop in time; exiting anyway",
      file=sys.stderr,
      flush=True,
    )
    sys.stdout.flush()
    os._exit(1)
  engine.close()  # several processes: the followers stop too (the engine loop has ended: this thread owns it)
  print("[server] stopped", flush=True)


if __name__ == "__main__":
  from hisparse_jax import cli

  cli.run(main)
