"""The benchmark and GPU-check scripts run end to end (quick modes) and produce sane numbers."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.xla_env import optimized

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_swap_in_benchmark_quick(tmp_path):
  out = tmp_path / "b"
  r = subprocess.run(
    [sys.executable, "benchmarks/swap_in.py", "--quick", "--out", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  rows = json.loads((tmp_path / "b.json").read_text())["points"]
  assert "book_us" in (tmp_path / "b.md").read_text()
  assert len(rows) == 2
  for row in rows:
    assert row["call_ms"] > 0 and row["bookkeeping_us"] >= 0 and row["memcpy_GBps"] > 0
  full = rows[-1]  # every top-k position a miss: the copy dominates and is measurable
  assert full["miss_fraction"] == 1.0 and full["miss_GBps"] and full["miss_GBps"] > 0.05


def test_gpu_check_dry_run_on_cpu(tmp_path):
  out = tmp_path / "g.json"
  r = subprocess.run(
    [sys.executable, "scripts/gpu_check.py", "--platform", "cpu", "--quick", "--out", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=900,
    env=optimized(),
  )  # real-size programs
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  report = json.loads(out.read_text())
  assert report["working_paths"] == ["pinned_host", "extension"]
  for path in report["working_paths"]:
    c = report["correctness"][path]
    assert c["cases"] == 16 and not c["failures"] and c["bad_input_is_error"]
  # The miss copy by the planning block alone, then the handler's choice (the CPU handler ignores it).
  assert [(r["miss_fraction"], r["copy_blocks"]) for r in report["sweep"]] == [(1.0, 1), (0.05, 0), (1.0, 0)]
  for mode in ("eager", "graph"):  # the decode-like step runs in both modes (on CPU the flags change nothing)
    assert report["graph_step"][mode]["ms_per_step"] > 0, report["graph_step"]
  # benchmarks/prefetch.py --quick: the all-hits step copies nothing; the prefetch copies rows and the swap-ins
  # after it copy fewer than without it (the calibrated trace's adjacent layers agree).
  assert [row["batch"] for row in report["prefetch"]] == [1, 4], report["prefetch"]
  assert [row["batch"] for row in report["prefetch_real_layer"]] == [1, 4], report["prefetch_real_layer"]
  for row in report["prefetch"] + report["prefetch_real_layer"]:
    assert row["hits_copied_per_step"] == 0 and row["prefetched_per_step"] > 0
    assert 0 < row["prefetch_copied_per_step"] < row["misses_copied_per_step"]
    assert row["hits_ms"] > 0 and row["misses_ms"] > 0 and row["prefetch_ms"] > 0
  # the JSON is rewritten after each step, each step's time recorded
  assert set(report["section_seconds"]) == {
    "probes",
    "correctness",
    "graph_step",
    "prefetch",
    "prefetch_real_layer",
    "sweep",
    "generate",
    "total",
  }
  # end to end: dense and HiSparse greedy tokens agree, and the HiSparse run really missed, with either KV cache
  g = report["generate"]
  for kv in ("", "_fp8"):
    assert g["ok"] and len(g["same_tokens" + kv]) == 3 and all(g["same_tokens" + kv]), g
    assert all(m > 0 for m in g["misses" + kv]), g


def test_step_floor_quick(tmp_path):
  out = tmp_path / "sf"
  r = subprocess.run(
    [sys.executable, "benchmarks/step_floor.py", "--quick", "--out", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  rows = json.loads((tmp_path / "sf.json").read_text())["rows"]
  assert [(x["batch"], x["mode"]) for x in rows] == [(2, "dense"), (2, "hisparse"), (2, "resident")]
  for x in rows:
    assert x["bucket"] == x["batch"]  # the whole batch decoded in every timed step
    assert x["flops"] > 2 * x["batch"] * 256 * 129280  # at least the output projection
    assert 0 < x["floor_ms"] == max(x["compute_floor_ms"], x["memory_floor_ms"])
    assert 0 < x["gemm_ms"] == min(x["gemm_hv_ms"], x["gemm_vh_ms"], x["gemm_vb_ms"])  # the fastest GEMM form
    # (Sane values only: two timings are not compared here, a loaded machine breaks any relation between them;
    # an overlapped step read 27 ms against a plain one's 71 in a fresh-clone run. BENCHMARKS.md has them.)
    assert x["step_ms"] > 0 and x["engine_step_ms"] > 0 and x["overlapped_step_ms"] > 0
    assert x["steps_timed"] == 6 - 3  # one round per timed step, the first 3 untimed
    for key in ("ratio", "engine_ratio", "overlapped_ratio"):  # medians over rounds, inside their quartiles
      lo, hi = x[f"{key}_iqr"]
      assert 0 < lo <= x[key] <= hi
  assert "| 2 | resident |" in (tmp_path / "sf.md").read_text()


def test_miss_rate_quick():
  """Without --out a quick run writes under benchmarks/results/quick/ (git-ignored), not over the committed
  results of the same name."""
  committed = os.path.join(REPO, "benchmarks", "results", "miss_rate.json")
  before = open(committed, "rb").read()
  quick = pathlib.Path(REPO, "benchmarks", "results", "quick")
  for f in quick.glob("miss_rate.*"):  # an earlier run's
    f.unlink()
  r = subprocess.run(
    [sys.executable, "benchmarks/miss_rate.py", "--quick"], cwd=REPO, capture_output=True, text=True, timeout=900
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]  # exit 1 if Python LRU != the kernel
  assert open(committed, "rb").read() == before
  assert subprocess.run(["git", "check-ignore", "-q", str(quick / "miss_rate.json")], cwd=REPO).returncode == 0
  # A full run without --out (any settings) writes under results/local/, git-ignored as well.
  from benchmarks.cli import default_out

  local = default_out("miss_rate", quick=False) + ".json"
  assert pathlib.Path(local).parent == quick.parent / "local"
  assert subprocess.run(["git", "check-ignore", "-q", local], cwd=REPO).returncode == 0
  out = quick / "miss_rate"
  data = json.loads(out.with_suffix(".json").read_text())["misses"]
  for D in (128, 256):
    assert data[f"lru@{D}"] == data[f"lru-kernel@{D}"] and data[f"clock@{D}"] == data[f"clock-kernel@{D}"]
    # Belady is the lower bound of every policy; a bigger buffer never misses more under it.
    for p in ("lru", "fifo", "clock", "lfu", "score-kernel", "score-ema-kernel", "content-oracle"):
      assert sum(data[f"belady@{D}"]) <= sum(data[f"{p}@{D}"])
  assert sum(data["belady@256"]) <= sum(data["belady@128"])
  assert out.with_suffix(".png").stat().st_size > 10_000 and "| 256 |" in out.with_suffix(".md").read_text()


def test_vs_transformers_quick(tmp_path):
  from tests.oracle_runner import require_oracle

  require_oracle()
  out = tmp_path / "vs"
  r = subprocess.run(
    [sys.executable, "benchmarks/vs_transformers.py", "--quick", "--out", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]  # exit 1: first tokens differ
  report = json.loads((tmp_path / "vs.json").read_text())
  assert report["first_token_ok"] and set(report["rows"]) == {"1", "2"}
  for b, row in report["rows"].items():
    assert row["ours_tok_s"] > 0 and row["transformers_tok_s"] > 0
    assert row["first_token_agree"] == int(b)  # against transformers with our top-k tie-break
    assert all(len(ids) == 8 for ids in report["ours"][b]["ids"] + report["transformers"]["batches"][b]["ids"])
  assert "| 2 |" in (tmp_path / "vs.md").read_text()


def test_server_load_quick(tmp_path):
  """The hostile-load benchmark runs end to end: the small request and Health keep answering under a text
  flood and open streams, the over-limit text and the streams past the queue bound are refused."""
  out = tmp_path / "load"
  r = subprocess.run(
    [sys.executable, "benchmarks/server_load.py", "--quick", "--out", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
  res = json.loads((tmp_path / "load.json").read_text())
  assert res["over_limit"]["code"] == "INVALID_ARGUMENT"
  assert res["streams_phase"]["over_queue_codes"] == ["RESOURCE_EXHAUSTED"]
  assert res["text"]["flood_codes"] == ["INVALID_ARGUMENT"] and res["text"]["flood_requests"] >= 4
  assert res["text"]["small"]["n"] == 3 and res["after"]["rss_mb"] > 0
  assert res["streams_phase"]["other_first_token"]["n"] == 3  # (another client, served while the streams wait)


def test_moe_benchmark_quick(tmp_path):
  out = tmp_path / "moe"
  r = subprocess.run(
    [sys.executable, "benchmarks/moe.py", "--quick", "--ep", "4", "--out", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  res = json.loads((tmp_path / "moe.json").read_text())
  rows = res["rows"]
  assert [row["tokens"] for row in rows] == [1, 32]
  for row in rows:
    assert row["dense_ms"] > 0 and row["grouped_ms"] > 0 and row["rel_diff"] < 1e-5 and row["ideal"] == 8
  assert [row["tokens"] for row in res["ep"]] == [4, 32]  # tokens in all, a multiple of the 4 groups
  for row in res["ep"]:
    assert row["devices"] == 4 and row["psum_ms"] > 0 and row["all_to_all_ms"] > 0 and row["rel_diff"] < 1e-5
    assert row["all_to_all_bytes"] < row["psum_bytes"]


def test_sharded_load_benchmark_quick(tmp_path):
  """2 processes x 4 devices load a checkpoint onto a mesh and report their shards and peak memory."""
  r = subprocess.run(
    [sys.executable, "benchmarks/sharded_load.py", "--quick", "--out", str(tmp_path / "sl")],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  rows = json.loads((tmp_path / "sl.json").read_text())["rows"]
  assert [row["process"] for row in rows] == [0, 1] and all(row["mesh"] == [2, 4, 8] for row in rows)
  for row in rows:
    assert row["shard_bytes"] > 0 and row["peak_bytes"] > 0 and row["ratio"] == row["peak_bytes"] / row["shard_bytes"]


def test_disaggregation_benchmark_quick(tmp_path):
  """The KV transfer next to memcpy, and streams' latency while prompts arrive, colocated and disaggregated."""
  r = subprocess.run(
    [sys.executable, "benchmarks/disaggregation.py", "--quick", "--out", str(tmp_path / "pd")],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads((tmp_path / "pd.json").read_text())
  assert [row["mib"] for row in res["transfer"]] == [1, 4]
  for row in res["transfer"]:
    assert row["pull_gbs"] > 0 and row["memcpy_gbs"] > 0 and row["worker_pull_ms"] > 0
  assert [(row["mode"], row["decode"]) for row in res["latency"]] == [("colocated", "dense"), ("pd", "hisparse")]
  for row in res["latency"]:
    assert row["itl_samples"] > 0 and row["itl_p50_ms"] > 0 and row["ttft_mean_s"] > 0
  pd = res["latency"][1]
  assert pd["pd_prefill_mean_s"] > 0 and pd["pd_transfer_mean_s"] > 0


def test_residency_benchmark_quick(tmp_path):
  out = tmp_path / "res"
  r = subprocess.run(
    [sys.executable, "benchmarks/residency.py", "--quick", "--out", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]  # exit 1 if the resident engine swapped in
  (row,) = json.loads((tmp_path / "res.json").read_text())["rows"]
  assert row["batch"] == 1 and row["rounds"] == 5 and row["hisparse_misses_per_step"] > 0
  for mode in ("dense", "hisparse", "resident"):
    assert row[f"{mode}_ms"] > 0
  assert 0 < row["resident_over_dense_iqr"][0] <= row["resident_over_dense"] <= row["resident_over_dense_iqr"][1]


def test_kv_dtype_benchmark_quick(tmp_path):
  out = tmp_path / "kvd"
  r = subprocess.run(
    [sys.executable, "benchmarks/kv_dtype.py", "--quick", "--out", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  (row,) = json.loads((tmp_path / "kvd.json").read_text())["rows"]
  assert (row["batch"], row["context"], row["dtype"], row["hidden"]) == (1, 4096, "float32", 1024)
  # DeepSeek-V3.2's real widths in float32: a 576-value latent row against 512 e4m3 + 4 scales + 64 float32
  # RoPE values; a 128-value key against 128 e4m3 + 1 scale.
  assert (row["auto"]["row_bytes"], row["auto"]["key_bytes"]) == (2304, 512)
  assert (row["fp8_e4m3"]["row_bytes"], row["fp8_e4m3"]["key_bytes"]) == (784, 132)
  for kind in ("auto", "fp8_e4m3"):
    assert all(row[kind][k] > 0 for k in ("step_ms", "gather_ms", "rows_ms", "keys_ms")), row
  assert row["ratio"] == row["fp8_e4m3"]["step_ms"] / row["auto"]["step_ms"]
  assert "| 1 | 4096 | float32 | " in (tmp_path / "kvd.md").read_text()


@pytest.mark.parametrize(
  "script, flags, message",
  [
    ("swap_in.py", ["--batch", "0"], "argument --batch: 0 is outside [1, 4096]"),
    ("swap_in.py", ["--miss", "nan"], "argument --miss: nan is outside [0.0, 1.0]"),
    ("swap_in.py", ["--repeats", "0"], "argument --repeats: 0 is outside [1, 10000]"),
    ("swap_in.py", ["--row-bytes", "1000000"], "more than 80% of this machine's"),
    ("swap_in.py", ["--out", "FILE/x"], "FILE is a file, not a folder"),
    ("long_context.py", ["--itl-prompt", "10"], "argument --itl-prompt: 10 is outside [64, 2147483647]"),
    ("moe.py", ["--tokens", "100000000"], "the dense evaluation's activations (--tokens x --experts x --inter) need"),
    ("kv_dtype.py", ["--contexts", str(2**63 - 1)], f"argument --contexts: {2**63 - 1} is outside [2049, 163840]"),
    ("miss_rate.py", ["--out", "results/"], "argument --out: 'results/': expected a file name, not a folder"),
    ("prefetch.py", ["--out", ""], "argument --out: '': expected a file name"),
  ],
)
def test_bad_benchmark_flags_fail_before_any_work(tmp_path, script, flags, message):
  """A size that would not fit in memory, a value outside its range or a results path that cannot be written is
  an argparse error (exit 2) before anything is computed or allocated."""
  (tmp_path / "FILE").write_text("a file, not a folder")
  flags = [f.replace("FILE", str(tmp_path / "FILE")) for f in flags]
  r = subprocess.run(
    [sys.executable, f"benchmarks/{script}", *flags], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_connection_flood_quick(tmp_path):
  """The connection-flood benchmark runs end to end: the server holds at most --max-connections of the flood's
  connections, and the open channel's Health and GetLoads answered throughout."""
  r = subprocess.run(
    [sys.executable, "benchmarks/connection_flood.py", "--quick", "--out", str(tmp_path / "flood")],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads((tmp_path / "flood.json").read_text())
  assert res["max_connections"] == 100 and res["flooder_opened"] >= 300
  assert res["server_descriptors_max"] <= res["server_descriptors_baseline"] + 100 + 64
  assert res["during_flood"]["calls"] > 0 and res["idle"]["calls"] > 0
