"""The throughput benchmark and the recorded top-k trace run end to end in their quick modes."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np

from tests.xla_env import optimized

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=600, env=None):
  r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return r


def test_throughput_quick(tmp_path):
  """Real sizes (top_k 2048, hot buffer 4096) at a 4k context: both sections run and the budget binds."""
  out = tmp_path / "tp"
  _run("benchmarks/throughput.py", "--quick", "--out", str(out), env=optimized())  # (running dominates it)
  res = json.loads((tmp_path / "tp.json").read_text())
  new = res["new_tokens"]
  assert res["hisparse"]["top_k"] == 2048 and res["hisparse"]["device_buffer_size"] == 4096
  for section in ("e2e", "decode"):
    points = res[section]
    assert {p["mode"] for p in points} == {"dense", "hisparse"}
    for p in points:
      assert p["tokens"] == p["concurrency"] * new and p["tokens_per_s"] > 0 and p["decode_tokens_per_s"] > 0
      assert 1 <= p["admitted"] <= min(p["slots"], p["concurrency"]) and p["ttft_mean_s"] > 0
  at8 = {p["mode"]: p for p in res["decode"] if p["concurrency"] == 8}
  assert at8["dense"]["admitted"] == 4  # the budget is 4 dense requests of this context
  assert at8["hisparse"]["misses_per_step"] > 0
  assert "HiSparse/dense" in (tmp_path / "tp.md").read_text()
  cap = res["capacity"][0]
  assert cap["dense"] == 4 and cap["deepseek_v32"]["dense"] == 4 and cap["deepseek_v32"]["hisparse"] >= 1


def test_long_context_quick(tmp_path):
  out = tmp_path / "lc"
  _run("benchmarks/long_context.py", "--quick", "--out", str(out))
  res = json.loads((tmp_path / "lc.json").read_text())
  by = {(r["mode"], r["prompt"]): r for r in res["prefill"]}
  for mode in ("dense", "hisparse"):
    assert by[(mode, 512)]["peak_rss_mb"] >= by[(mode, 512)]["rss_before_mb"] > 0
    assert by[(mode, 512)]["prefill_s"] > 0
  assert by[("hisparse", 512)]["misses"] > 0
  itl = res["itl"]
  assert [r["chunk"] for r in itl] == [None, 256, 0] and all(r["itl_p50_ms"] > 0 for r in itl)
  assert itl[1]["ttft_s"] > 0 and itl[2]["ttft_s"] > 0
  # Nothing compiled while measured (the warm-up ran every shape: a quick run once timed a decode compile).
  assert [r["compiles"] for r in itl] == [0, 0, 0] and all(r["streams"] == 2 for r in itl)
  buckets = {(r["engine"], r["mode"]): r for r in res["bucket"]}
  assert buckets[("bucket", "dense")]["batch"] == 1 and buckets[("fixed 32", "dense")]["batch"] == 32


def test_recorded_trace_replay(tmp_path):
  """A real-size trace (top_k 2048) from the model's own indexer, replayed by the miss-rate script."""
  trace = tmp_path / "trace.npz"
  _run("benchmarks/record_trace.py", "--quick", "--out", str(trace), env=optimized())
  z = np.load(trace)
  steps = z["topk_1"]
  assert steps.shape == (3, 4, 2048) and int(z["prompt_tokens_1"]) == 2600
  for t in range(3):  # 2048 distinct causal positions per layer (the context is longer than top_k)
    for layer in range(4):
      row = steps[t, layer]
      assert len(np.unique(row)) == 2048 and row.min() >= 0 and row.max() <= 2600 + t
  _run("benchmarks/miss_rate.py", "--trace", str(trace), "--buffers", "2048,2560", "--out", str(tmp_path / "mr"))
  data = json.loads((tmp_path / "mr.json").read_text())
  assert data["streams"] == 4
  m = data["misses"]
  for D in (2048, 2560):
    assert m[f"lru@{D}"] == m[f"lru-kernel@{D}"]
    assert sum(m[f"belady@{D}"]) <= sum(m[f"lru@{D}"])
  assert sum(m["lru@2560"]) <= sum(m["lru@2048"]) and sum(m["lru@2048"]) > 0


def test_benchmark_scripts_refuse_bad_input(tmp_path):
  def fails(args, message):
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]

  np.savez(tmp_path / "none.npz", topk_1=np.zeros((0, 3, 8), np.int32), prompt_tokens_1=np.int64(5))
  np.savez(tmp_path / "other.npz", x=np.zeros(3))
  (tmp_path / "text.npz").write_text("not a trace")
  mr = "benchmarks/miss_rate.py"
  fails([mr, "--trace", str(tmp_path / "none.npz")], "no request has a decode step to replay")
  fails([mr, "--trace", str(tmp_path / "other.npz")], "expected topk_<line> and prompt_tokens_<line>")
  fails([mr, "--trace", str(tmp_path / "text.npz")], "not an .npz archive")
  fails([mr, "--trace", str(tmp_path / "missing.npz")], "No such file or directory")
  np.savez(tmp_path / "empty.npz")  # --dump-topk of a run without requests: an empty zip archive
  fails([mr, "--trace", str(tmp_path / "empty.npz")], "expected topk_<line> and prompt_tokens_<line>")
  rt = "benchmarks/record_trace.py"
  fails([rt, "--prompt-tokens", "2048"], "--prompt-tokens must exceed the model's top_k (2048)")
  fails([rt, "--new-tokens", "1"], "--new-tokens must be >= 2")
  (tmp_path / "cut.npz").write_bytes((tmp_path / "none.npz").read_bytes()[:100])  # a truncated archive
  fails([mr, "--trace", str(tmp_path / "cut.npz")], "not a readable .npz trace")
  with zipfile.ZipFile(tmp_path / "junk.npz", "w") as z:  # a member that is not an .npy array
    z.writestr("topk_1.npy", b"garbage")
    z.writestr("prompt_tokens_1.npy", b"garbage")
  fails([mr, "--trace", str(tmp_path / "junk.npz")], "topk_1 must be an integer array [steps, layers, top_k]")
  np.savez(tmp_path / "far.npz", topk_1=np.array([[[0, 6]]], np.int32), prompt_tokens_1=np.int64(5))
  fails([mr, "--trace", str(tmp_path / "far.npz")], "topk_1 has a position outside [-1, prompt_tokens + step]")
  np.savez(tmp_path / "two.npz", topk_1=np.array([[[0, 5]]], np.int32), prompt_tokens_1=np.array([5, 6]))
  fails([mr, "--trace", str(tmp_path / "two.npz")], "prompt_tokens_1 must be an integer in [1, 4194304")
  fails(
    [mr, "--trace-model", "synthetic", "--context", "10", "--top-k", "64", "--buffers", "64"],
    "--trace-model synthetic needs --context >= top_k",
  )
  fails([mr, "--context", str(10**11)], "--context + --steps and --buffers must be <= 4194304")
  fails([mr, "--quick", "--out", "/proc/nope/x"], "argument --out: '/proc/nope/x': cannot write in /proc/nope")
  fails([mr, "--buffers", "8,abc"], "expected comma-separated integers")
  fails([mr, "--top-k", "128", "--buffers", "64"], "must be >= top_k (128)")
  fails(["benchmarks/throughput.py", "--sections", "foo"], "unknown section(s) ['foo']")
  fails(["benchmarks/throughput.py", "--concurrency", "0"], "expected positive integers")
  fails(["benchmarks/throughput.py", "--contexts", "1000"], "at least 4128")
  fails(["benchmarks/long_context.py", "--sections", "bar"], "unknown section(s) ['bar']")
  fails(["benchmarks/prefetch.py", "--mlp", "7168"], "expected two comma-separated integers H,F, got '7168'")
  fails(["benchmarks/prefetch.py", "--mlp", "512,1024"], "--mlp H,F: H must be >= 576, got 512")
  fails([mr, "--top-k", "5000", "--context", "4096"], "the calibrated trace needs --top-k (5000) < --context (4096)")
