r"""Starts the hisparse-jax gRPC inference server.

  python run_server.py [--model-path DIR] [--host 127.0.0.1] [--port 50051] \
      [--enable-hisparse [--hisparse-config JSON] [--host-pool jax|extension]] \
      [--max-running-requests 64] [--max-seq-len N] [--chunked-prefill-size 2048] [--page-size 64] \
      [--max-device-kv-bytes N | --mem-fraction-static F] [--deterministic] [--dtype ...] \
      [--shutdown-grace-s 5] [--metrics-port P]

Engine flags are ``hisparse_jax.engine.args.EngineArgs`` (shared with the batch script).

Serves ``hisparse.HiSparseInference/Generate`` (server streaming) and
``grpc.health.v1.Health``. Stops cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
flags.DEFINE_integer("port", 50051, "Port to bind (0: pick a free one; the chosen port is printed).")
flags.DEFINE_float("shutdown-grace-s", 5.0, "Seconds in-flight RPCs get to finish on SIGTERM; "
                   "streams still open then end with UNAVAILABLE.")
flags.DEFINE_integer("metrics-port", None, "Serve Prometheus metrics at http://HOST:PORT/metrics.")


def _define_engine_flags():
  from hisparse_jax.engine.args import EngineArgs
  EngineArgs.define_flags(max_queued_requests=1024)


_define_engine_flags()


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from hisparse_jax.engine.args import EngineArgs, StartupError, load_tokenizer_or_fail
  try:
    if not 0 <= FLAGS.port <= 65535:
      raise StartupError(f"--port {FLAGS.port}: expected 0..65535")
    args = EngineArgs.from_flags()
    args.validate()
    model_dir = args.model_dir()
    tokenizer = load_tokenizer_or_fail(model_dir)
    from hisparse_jax.engine import Engine
    engine = Engine(args, tokenizer=tokenizer)
  except StartupError as e:
    sys.exit(f"error: {e}")

  from hisparse_jax.serving.metrics import ServerMetrics
  from hisparse_jax.serving.server import serve

  metrics = ServerMetrics(row_bytes=engine.config.latent_dim * engine.dtype.itemsize)
  if FLAGS["metrics-port"].value is not None:
    try:
      metrics.serve(FLAGS["metrics-port"].value, FLAGS.host)
    except OSError as e:
      sys.exit(f"error: --metrics-port {FLAGS['metrics-port'].value}: {e}")
  try:
    server, loop, port = serve(engine, tokenizer, FLAGS.host, FLAGS.port, metrics=metrics)
  except OSError as e:
    sys.exit(f"error: --host/--port: {e}")
  mode = f"hisparse {engine.hisparse}, host pool: {args.host_pool}" if engine.hisparse else "dense"
  metrics_at = (f", metrics at http://{FLAGS.host}:{FLAGS['metrics-port'].value}/metrics"
                if FLAGS["metrics-port"].value is not None else "")
  print(f"[server] listening on {FLAGS.host}:{port} ({mode}, model {model_dir}){metrics_at}", flush=True)
  stopping = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stopping.set())
  stopping.wait()
  print("[server] shutting down", flush=True)
  server.stop(FLAGS["shutdown-grace-s"].value).wait()
  loop.stop(timeout=FLAGS["shutdown-grace-s"].value + 30)
  print("[server] stopped", flush=True)


if __name__ == "__main__":
  app.run(main)
