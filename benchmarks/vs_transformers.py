r"""New tokens/s of our jitted decode vs transformers' eager ``generate``, same checkpoint, side by side.

  python benchmarks/vs_transformers.py [--quick] [--batches 1,8,32] [--prompt-len 120] [--new-tokens 64] \
      [--repeats 3] [--threads N] [--max-seq-len N] [--out benchmarks/results/vs_transformers]

Checkpoint: the embedded default model (``hisparse_jax.default_model``; HF
safetensors, DeepseekV32ForCausalLM, stored bf16), run in float32 on both
sides. Prompts: ``--prompt-len`` token ids drawn from a seeded numpy RNG in
[2, 100000) (no BOS, no padding); batch B uses the first B prompts, the same
on both sides. Greedy, exactly ``--new-tokens`` new tokens per request (EOS
ignored on both sides).

  ours          ``Engine(model_dir, dtype="float32", max_running_requests=B)`` (dense KV cache),
                B ``Request(..., ignore_eos=True)`` submitted, then the engine stepped until done
                (what ``Engine.run`` does; each step is timed too). Its KV cache and indexer keys
                span ``--max-seq-len`` positions (default: the engine's own, 4096 for this model); a
                decode step's indexer scores a power-of-two window covering the longest request
                (at least 256 positions), while transformers' cache grows with the tokens so far.
  transformers  ``benchmarks/hf_generate_timing.py`` in the oracle env (``.venv-oracle``, or
                ``$HISPARSE_ORACLE_PYTHON``): ``AutoModelForCausalLM.from_pretrained(dtype=float32)``,
                eval, ``torch.inference_mode()``, ``generate(do_sample=False, max_new_tokens=N,
                min_new_tokens=N)``, ``torch.set_num_threads(--threads)`` (default: all cores).

Per batch size and side: one untimed warm-up run with the same shapes (jit
compilation; transformers' first-call costs), then ``--repeats`` timed runs;
the reported time is their median (the speed-up of the fastest repeats is
reported too: on a shared machine another process slows some repeats, torch's
OpenMP threads far more than XLA's). The time covers everything from submit /
``generate`` call to the last token, prefill included (generate includes
it): tokens/s = B x new tokens / seconds. Also reported: milliseconds per
decode step (one new token for each of the B requests; median over every
step of the timed runs; our step = the step's wall time, theirs = the gap
between consecutive logits-processor calls). The transformers run goes
first, then ours, one at a time (never concurrently).

Sanity check ("same model"): for every prompt, our first generated token
must equal transformers' when its indexer top-k breaks ties as ours does
(equal scores: lowest position first; an extra untimed call, see
hf_generate_timing.py: the default model's 4 indexer heads give exact 0.0
ties at the top-k boundary, which stock ``torch.topk`` orders differently);
else exit 1, after writing the results. Reported: first-token agreement and
the common prefix of the greedy continuations, against that call and against
the timed stock calls (fp32 rounding and top-k ties flip near-tied tokens; a
shorter prefix is reported, not an error).

Writes OUT.json (all raw numbers, versions, thread counts, CPU busy share of
other processes just before and after the run) and OUT.md (the
table), and prints the table. Exit 2 if the oracle Python does not exist.
``--quick`` (CI smoke: does it run, are the numbers sane): batches 1,2, 8 new
tokens, 1 repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from hisparse_jax.default_model import ensure_default_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli import OUT_HELP, default_out, out_path  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = os.path.join(REPO, "benchmarks", "hf_generate_timing.py")
ORACLE_PYTHON = os.environ.get("HISPARSE_ORACLE_PYTHON", os.path.join(REPO, ".venv-oracle", "bin", "python"))
PROMPT_SEED = 0
# Prompt ids avoid 0 (BOS) and 1 (EOS) and stay well inside the vocabulary.
PROMPT_ID_RANGE = (2, 100000)


def make_prompts(n: int, length: int, seed: int = PROMPT_SEED) -> list[list[int]]:
  """n prompts of `length` token ids, uniform in PROMPT_ID_RANGE, from numpy's default_rng(seed)."""
  return np.random.default_rng(seed).integers(*PROMPT_ID_RANGE, (n, length)).tolist()


def time_ours(model_dir: str, prompts: list[list[int]], new_tokens: int, repeats: int, max_seq_len: int | None) -> dict:
  """Warm-up + `repeats` timed submit-and-run passes of our engine over all of `prompts` at once.

  Returns times_s (each repeat, seconds), step_ms (wall time of every engine step after the first of
  every timed repeat: decode only), first_step_s (the first step: every prefill + one decode step),
  warmup_s, init_s (Engine construction: checkpoint load) and ids (int[B][new_tokens], last repeat).
  """
  from hisparse_jax.engine import Engine, Request

  t0 = time.perf_counter()
  engine = Engine(model_dir, dtype="float32", max_running_requests=len(prompts), max_seq_len=max_seq_len)
  init_s = time.perf_counter() - t0

  def one_pass():
    reqs = [Request(f"r{i}", p, max_new_tokens=new_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
    stamps = [time.perf_counter()]
    for r in reqs:
      engine.submit(r)
    while engine.has_work():  # Engine.run(), with a time stamp per step
      engine.step()
      stamps.append(time.perf_counter())
    for r in reqs:
      if len(r.output_ids) != new_tokens:
        raise RuntimeError(
          f"request {r.request_id}: {len(r.output_ids)} tokens ({r.finish_reason}), expected {new_tokens}"
        )
    return stamps, [r.output_ids for r in reqs]

  t0 = time.perf_counter()
  one_pass()
  warmup_s = time.perf_counter() - t0
  times, step_ms, first_step_s = [], [], []
  for _ in range(repeats):
    stamps, ids = one_pass()
    times.append(stamps[-1] - stamps[0])
    first_step_s.append(stamps[1] - stamps[0])
    step_ms += (np.diff(stamps[1:]) * 1e3).tolist()
  return dict(
    init_s=init_s,
    warmup_s=warmup_s,
    times_s=times,
    step_ms=step_ms,
    first_step_s=first_step_s,
    ids=ids,
    max_seq_len=engine.max_seq_len,
  )


def run_transformers(
  model_dir: str, prompts: list[list[int]], batches: list[int], new_tokens: int, repeats: int, threads: int
) -> dict:
  """Runs the worker (hf_generate_timing.py) in the oracle env; returns its JSON (RuntimeError on failure)."""
  with tempfile.TemporaryDirectory() as tmp:
    ppath, out = os.path.join(tmp, "prompts.json"), os.path.join(tmp, "hf.json")
    with open(ppath, "w") as f:
      json.dump(prompts, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    cmd = [
      ORACLE_PYTHON,
      WORKER,
      "--model-dir",
      model_dir,
      "--prompts",
      ppath,
      "--batches",
      ",".join(map(str, batches)),
      "--new-tokens",
      str(new_tokens),
      "--repeats",
      str(repeats),
      "--threads",
      str(threads),
      "--out",
      out,
    ]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
      raise RuntimeError(f"transformers worker failed (exit {r.returncode}):\n{r.stdout[-4000:]}")
    with open(out) as f:
      return json.load(f)


def cpu_busy(seconds: float = 1.0) -> float | None:
  """Fraction of all cores busy (0..1) over the next `seconds`, from /proc/stat (None elsewhere):
  before the run, the share other processes use; a benchmark on a busy machine is flagged."""

  def read():
    with open("/proc/stat") as f:
      v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]  # total, idle + iowait (jiffies)

  try:
    t0, i0 = read()
    time.sleep(seconds)
    t1, i1 = read()
  except OSError:
    return None
  return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def common_prefix(a: list[int], b: list[int]) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--prompt-len", type=int, default=120)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
  ap.add_argument("--max-seq-len", type=int, default=None, help="our Engine's max_seq_len (default: the engine's own)")
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  ap.add_argument("--quick", action="store_true", help="batches 1,2, 8 new tokens, 1 repeat (CI smoke)")
  args = ap.parse_args(argv)
  args.out = args.out or default_out("vs_transformers", args.quick)
  if args.quick:
    args.batches, args.new_tokens, args.repeats = "1,2", 8, 1
  if not os.path.exists(ORACLE_PYTHON):
    print(
      f"error: oracle python {ORACLE_PYTHON} does not exist (set HISPARSE_ORACLE_PYTHON; "
      "`make test` creates .venv-oracle)",
      file=sys.stderr,
    )
    return 2
  batches = [int(x) for x in args.batches.split(",")]
  busy_before = cpu_busy()
  t_start = time.perf_counter()
  model_dir = ensure_default_model()
  prompts = make_prompts(max(batches), args.prompt_len)

  theirs = run_transformers(model_dir, prompts, batches, args.new_tokens, args.repeats, args.threads)
  ours = {}
  for b in batches:
    ours[str(b)] = time_ours(model_dir, prompts[:b], args.new_tokens, args.repeats, args.max_seq_len)
    print(f"ours batch {b}: {statistics.median(ours[str(b)]['times_s']):.3f} s", flush=True)

  rows, first_token_ok = {}, True
  for b in batches:
    o, t = ours[str(b)], theirs["batches"][str(b)]
    o_s, t_s = statistics.median(o["times_s"]), statistics.median(t["times_s"])
    first = [oi[0] == ti[0] for oi, ti in zip(o["ids"], t["aligned_ids"])]
    first_stock = [oi[0] == ti[0] for oi, ti in zip(o["ids"], t["ids"])]
    prefix = [common_prefix(oi, ti) for oi, ti in zip(o["ids"], t["aligned_ids"])]
    prefix_stock = [common_prefix(oi, ti) for oi, ti in zip(o["ids"], t["ids"])]
    first_token_ok &= all(first)
    rows[str(b)] = dict(
      ours_s=o_s,
      transformers_s=t_s,
      ours_tok_s=b * args.new_tokens / o_s,
      transformers_tok_s=b * args.new_tokens / t_s,
      speedup=t_s / o_s,
      speedup_best=min(t["times_s"]) / min(o["times_s"]),
      ours_step_ms=statistics.median(o["step_ms"]) if o["step_ms"] else None,
      transformers_step_ms=statistics.median(t["step_ms"]) if t["step_ms"] else None,
      first_token_agree=sum(first),
      first_token_agree_stock=sum(first_stock),
      common_prefix=prefix,
      common_prefix_stock=prefix_stock,
    )

  lines = [
    "| batch | ours tok/s | transformers tok/s | speed-up | speed-up, best of repeats | first-token agreement (aligned / stock) | "
    "ours ms/decode step | transformers ms/decode step | common greedy prefix, aligned (min / mean) | "
    "common greedy prefix, stock (min / mean) |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  step = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
  for b in batches:
    r = rows[str(b)]
    lines.append(
      f"| {b} | {r['ours_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | {r['speedup']:.2f}x | {r['speedup_best']:.2f}x | "
      f"{r['first_token_agree']}/{b} / {r['first_token_agree_stock']}/{b} | {step(r['ours_step_ms'])} | "
      f"{step(r['transformers_step_ms'])} | {min(r['common_prefix'])} / "
      f"{np.mean(r['common_prefix']):.1f} of {args.new_tokens} | {min(r['common_prefix_stock'])} / "
      f"{np.mean(r['common_prefix_stock']):.1f} of {args.new_tokens} |"
    )
  table = "\n".join(lines)
  total_s = time.perf_counter() - t_start
  busy_after = cpu_busy()
  header = (
    f"Default model (DeepseekV32ForCausalLM, float32), prompt {args.prompt_len} tokens, "
    f"{args.new_tokens} new tokens, greedy, median of {args.repeats} after a warm-up, prefill included; "
    f"{os.cpu_count()} CPU cores, torch threads {theirs['torch_threads']}, JAX on "
    f"{jax.devices()[0].platform} ({total_s:.0f} s in all)."
  )
  if busy_before is not None and max(busy_before, busy_after) > 0.25:  # torch's OpenMP threads suffer most
    header += (
      f"\n\nWarning: other processes kept {100 * busy_before:.0f}% of the CPUs busy just before the "
      f"run and {100 * busy_after:.0f}% just after; the numbers are not those of an idle machine."
    )
  print(header + "\n\n" + table)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".md", "w") as f:
    f.write(header + "\n\n" + table + "\n")
  versions = dict(
    python=platform.python_version(),
    jax=jax.__version__,
    numpy=np.__version__,
    oracle_python=theirs["python"],
    torch=theirs["torch"],
    transformers=theirs["transformers"],
  )
  machine = dict(
    cpu_count=os.cpu_count(),
    platform=platform.platform(),
    processor=platform.processor(),
    jax_backend=jax.devices()[0].platform,
    xla_flags=os.environ.get("XLA_FLAGS", ""),
    torch_threads=theirs["torch_threads"],
    torch_interop_threads=theirs["torch_interop_threads"],
    omp_num_threads=args.threads,
    cpu_busy_before=busy_before,
    cpu_busy_after=busy_after,
    loadavg_after=os.getloadavg(),
  )
  with open(args.out + ".json", "w") as f:
    json.dump(
      dict(
        args=vars(args),
        model_dir=model_dir,
        prompt_seed=PROMPT_SEED,
        versions=versions,
        machine=machine,
        total_s=total_s,
        first_token_ok=bool(first_token_ok),
        rows=rows,
        ours=ours,
        transformers=theirs,
      ),
      f,
    )
  if not first_token_ok:
    print(
      "error: the first generated token differs from transformers' (tie-break aligned) for some prompt: "
      "the two sides do not run the same model",
      file=sys.stderr,
    )
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
