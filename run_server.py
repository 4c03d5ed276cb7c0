r"""Starts the hisparse-jax gRPC inference server.

  python run_server.py [--model-path DIR] [--host 127.0.0.1] [--port 50051] \
      [--enable-hisparse [--hisparse-config JSON] [--host-pool jax|extension]] \
      [--max-running-requests 8] [--dtype ...] [--shutdown-grace-s 5]

Serves ``hisparse.HiSparseInference/Generate`` (server streaming) and
``grpc.health.v1.Health``. Stops cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("model-path", None, "HF-format model directory (default: the embedded model).")
flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
flags.DEFINE_integer("port", 50051, "Port to bind (0: pick a free one; the chosen port is printed).")
flags.DEFINE_string("dtype", None, "float32 or bfloat16 (default: the checkpoint's dtype).")
flags.DEFINE_boolean("enable-hisparse", False, "Keep the latent KV in a host pool with per-request hot buffers.")
flags.DEFINE_string("hisparse-config", None, "HiSparse sizes as JSON: top_k, device_buffer_size, host_to_device_ratio.")
flags.DEFINE_integer("max-running-requests", 8, "Decode lanes (requests decoded concurrently).")
flags.DEFINE_integer("max-seq-len", None, "Longest prompt + output per request, in tokens (default: "
                     "min(the model's max_position_embeddings, 4096)).")
flags.DEFINE_float("shutdown-grace-s", 5.0, "Seconds in-flight RPCs get to finish on SIGTERM; "
                   "streams still open then end with UNAVAILABLE.")
flags.DEFINE_integer("max-device-kv-bytes", None, "Device KV budget in bytes: requests are admitted while the KV "
                     "they hold on device fits (dense: full KV; HiSparse: hot buffer + indexer keys).")
flags.DEFINE_float("mem-fraction-static", None, "Device KV budget as a fraction of the device memory limit (GPU).")
flags.DEFINE_integer("max-queued-requests", 1024, "Requests waiting beyond this fail with RESOURCE_EXHAUSTED.")
flags.DEFINE_integer("metrics-port", None, "Serve Prometheus metrics at http://HOST:PORT/metrics.")
flags.DEFINE_boolean("fp8-numerics", False, "DeepSeek-V3.2 FP8 deployment numerics: Hadamard-rotated e4m3 "
                     "indexer q/k and an e4m3 latent KV cache (fake-quantized).")
flags.DEFINE_string("host-pool", "jax", "HiSparse host pool: 'jax' (a pinned_host JAX array) or 'extension' "
                    "(memory owned by the FFI extension).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from hisparse_jax import launch
  try:
    launch.check_dtype(FLAGS.dtype)
    launch.check_host_pool(FLAGS["host-pool"].value, FLAGS["enable-hisparse"].value)
    if not 0 <= FLAGS.port <= 65535:
      raise launch.StartupError(f"--port {FLAGS.port}: expected 0..65535")
    model_dir = launch.resolve_model_path(FLAGS["model-path"].value)
    model_cfg = launch.read_model_config(model_dir)
    hisparse = launch.resolve_hisparse(FLAGS["enable-hisparse"].value, FLAGS["hisparse-config"].value,
                                       model_dir, model_cfg)
    launch.check_memory(model_cfg, hisparse, FLAGS["max-running-requests"].value, FLAGS.dtype)
    launch.check_max_seq_len(FLAGS["max-seq-len"].value, model_cfg)
    tokenizer = launch.load_tokenizer_or_fail(model_dir)
    budget = launch.device_kv_budget(FLAGS["max-device-kv-bytes"].value, FLAGS["mem-fraction-static"].value)
    if FLAGS["max-queued-requests"].value < 0:
      raise launch.StartupError("--max-queued-requests must be >= 0")
    engine = launch.build_engine(model_dir, dtype=FLAGS.dtype, hisparse=hisparse,
                                 max_running_requests=FLAGS["max-running-requests"].value,
                                 host_pool=FLAGS["host-pool"].value,
                                 fp8_numerics=FLAGS["fp8-numerics"].value, max_device_kv_bytes=budget,
                                 max_queued_requests=FLAGS["max-queued-requests"].value, tokenizer=tokenizer,
                                 max_seq_len=FLAGS["max-seq-len"].value)
  except launch.StartupError as e:
    sys.exit(f"error: {e}")

  from hisparse_jax.metrics import ServerMetrics
  from hisparse_jax.server import serve

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
  mode = f"hisparse {hisparse}, host pool: {FLAGS['host-pool'].value}" if hisparse else "dense"
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
