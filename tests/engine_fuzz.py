r"""Random workloads against the engine's scheduler, each request checked against itself decoded alone.

  python -m tests.engine_fuzz [--configs lru,score_ema,...] [--seeds 0-49] [--requests 24]
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.engine_fuzz --configs dp2_dense,dp2tp2_fp8

A workload (``workload``, seeded) is a sequence of engine steps. Before each step requests arrive: prompts from 1
token to past the hot buffer and the prefill chunk, 1 to 60 new tokens, greedy or seeded sampling with top-k /
top-p, stop token ids and stop strings, EOS honoured or ignored; some arrive with their prompt KV and first token
from a prefill engine (disaggregation), some are submitted from another request's ``on_token`` callback. Live
requests are aborted (waiting, prefilling or decoding; between steps or from their own callback), some callbacks
raise, and requests that must be refused are submitted (longer than the context, an id in use, an empty prompt).
The engine (``CONFIGS``: dense, each HiSparse eviction policy, the cross-layer prefetch, dynamic residency, an
FP8 KV cache, the plain and the overlapped schedule, a queue bound, DP / TP meshes) has a device KV budget that
holds only a few of the requests, so the scheduler preempts, and with residency offloads.

Checked (``run`` and ``check``), the scheduler's contract:
  - every accepted request ends exactly once (in ``step``'s return, or by an abort), with "error" only where its
    callback raised; a request refused for a full queue is refused only when the queue is full;
  - each one that was not aborted has exactly the tokens, finish reason and text of the same request decoded
    alone on a dense engine with the whole KV on device, the same KV cache dtype and TP size
    (``reference_engine``; ``--deterministic``: XLA's batch-invariant numerics; HiSparse is lossless, so every
    mode, schedule and DP split must give the alone tokens); an aborted one, or one whose callback raised, has a
    prefix of them;
  - refused submissions raise the documented error and change nothing;
  - afterwards every KV page and request slot is free, nothing is queued or resident, and the engine's preemption
    count is the sum of its requests'.

``tests/test_scheduling.py`` runs two seeds of some configurations; this module's command line runs many (a
failure names the seed and the request: ``--seeds N --configs NAME`` reproduces it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import numpy as np

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, InvalidRequest, Request, ResourceExhausted
from hisparse_jax.engine.detokenizer import load_tokenizer
from tests.tiny_model import TINY_HISPARSE, all_kv_free, scratch_dir, tiny_model_with_tokenizer

MAX_SEQ_LEN = 160
ENGINE = dict(
  page_size=16, chunked_prefill_size=32, max_seq_len=MAX_SEQ_LEN, max_running_requests=4, deterministic=True
)
# name -> (Engine keyword arguments, HiSparse settings or None). The device budgets hold about two or three of
# the workload's longer requests: pools run out and the scheduler preempts (dense: 12 pages of 16 tokens).
CONFIGS = {
  "dense": (dict(max_device_kv_bytes=12 * 16 * 768), None),
  "dense_plain": (dict(max_device_kv_bytes=12 * 16 * 768, overlap_schedule=False), None),
  "lru": (dict(max_device_kv_bytes=200_000), {}),
  "lru_plain": (dict(max_device_kv_bytes=200_000, overlap_schedule=False), {}),
  "clock_prefetch": (dict(max_device_kv_bytes=200_000), dict(eviction="clock", prefetch="next_layer")),
  "score_ema": (dict(max_device_kv_bytes=200_000), dict(eviction="score_ema")),
  "resident": (dict(max_device_kv_bytes=220_000), dict(resident_fraction=0.4, prefetch="next_layer", prefetch_depth=4)),
  "fp8_score_ema": (dict(max_device_kv_bytes=160_000, kv_cache_dtype="fp8_e4m3"), dict(eviction="score_ema")),
  "lru_queue": (dict(max_device_kv_bytes=200_000, max_queued_requests=1), {}),  # bursts are refused
  # Meshes (the process needs the devices: XLA_FLAGS=--xla_force_host_platform_device_count=N): each DP group
  # admits and preempts in its own pools.
  "dp2_lru": (dict(max_device_kv_bytes=200_000, dp_size=2), {}),
  "dp2_dense": (dict(max_device_kv_bytes=12 * 16 * 768, dp_size=2), None),
  "tp2_lru": (dict(max_device_kv_bytes=200_000, tp_size=2), {}),
  # (Four lanes per group: with two, no prompt ever needed a resident request's staging pages, and 42 seeds
  # offloaded nothing.)
  "dp2_resident": (
    dict(max_device_kv_bytes=220_000, dp_size=2, max_running_requests=8),
    dict(resident_fraction=0.4, eviction="clock", prefetch="next_layer"),
  ),
  # (Open: in one run of 60 seeds, one sampled request of seed 249 left its dp1 x tp2 reference at its 23rd
  # token; dp2 and tp2 alone, and another 61 seeds of this one, were exact. An FP8 cache can round a last-bit
  # difference to another FP8 value; where that difference comes from under DP x TP is not shown yet.)
  "dp2tp2_fp8": (
    dict(max_device_kv_bytes=160_000, dp_size=2, tp_size=2, kv_cache_dtype="fp8_e4m3"),
    dict(eviction="score_ema"),
  ),
}


STOP_STRINGS = ("e", "in", "the", "\n", "a ", ".")


@functools.lru_cache(maxsize=None)
def model_dir() -> str:
  """The tiny test model with the DeepSeek-V3 tokenizer beside it (stop strings and text need one)."""
  return tiny_model_with_tokenizer(os.path.join(scratch_dir("hisparse-fuzz-"), "model"))


def make_engine(name: str) -> Engine:
  kwargs, hisparse = CONFIGS[name]
  hs = None if hisparse is None else HiSparseConfig(**{**TINY_HISPARSE, **hisparse})
  return Engine(model_dir(), hisparse=hs, tokenizer=load_tokenizer(model_dir()), **{**ENGINE, **kwargs})


def reference_engine(kv_cache_dtype: str = "auto", tp_size: int = 1) -> Engine:
  """Dense KV stored as ``kv_cache_dtype``, no memory pressure, plain schedule, no DP groups, ``tp_size``-way
  tensor parallelism: what each request is compared with, run alone.

  A tensor-parallel engine is compared with one of the same ``tp_size``: TP splits the head and vocabulary
  reductions, so its logits differ from one device's in the last bits (the tiny model's by up to 1e-5 in float32;
  tests/mesh_check.py compares meshes by greedy tokens), and with an FP8 KV cache such a difference can round to
  another FP8 value; against one device, 2 of ~4,000 sampled requests at temperature 1.3 drew another token."""
  return Engine(
    model_dir(),
    tokenizer=load_tokenizer(model_dir()),
    **{**ENGINE, "overlap_schedule": False},
    kv_cache_dtype=kv_cache_dtype,
    tp_size=tp_size,
  )


class References:
  """The reference engine of each KV cache dtype and TP size (made when first needed), its alone runs by request
  inputs, and prompt KV exported by it (as a prefill server's)."""

  def __init__(self):
    self.engines, self.runs = {}, {}

  def engine(self, like: Engine) -> Engine:
    """The reference for engines like ``like`` (its KV cache dtype and TP size)."""
    key = (like.args.kv_cache_dtype, like.args.tp_size)
    if key not in self.engines:
      self.engines[key] = reference_engine(*key)
    return self.engines[key]

  def alone(self, like: Engine, r: Request) -> Request:
    """A request with r's inputs (its prompt KV not included) decoded alone."""
    key = (like.args.kv_cache_dtype, like.args.tp_size, *inputs(r).values())
    if key not in self.runs:
      alone = fresh(r)
      self.engine(like).submit(alone)
      self.engine(like).run()
      self.runs[key] = alone
    return self.runs[key]

  def export(self, like: Engine, r: Request) -> None:
    """Sets r.prompt_kv and r.first_token as a prefill server would: its prompt prefilled (greedy) with
    export_kv."""
    ex = Request("export", list(r.prompt_ids), 1, export_kv=True, ignore_eos=True)
    self.engine(like).submit(ex)
    self.engine(like).run()
    r.prompt_kv, r.first_token = ex.prompt_kv, ex.output_ids[0]


@dataclasses.dataclass
class Planned:
  """A request of a workload and how the workload treats it."""

  request: Request
  arrive_step: int
  abort_step: int | None = None  # aborted between steps, before this step
  abort_after_tokens: int | None = None  # aborted from its on_token callback at this many tokens
  raise_after_tokens: int | None = None  # its on_token callback raises at this many tokens (it ends in "error")
  imported: bool = False  # arrives with its prompt KV and first token (from a prefill server)
  parent: int | None = None  # submitted from this earlier request's on_token at its first token
  # (arrive_step: when it is submitted if the parent never gets one)


def random_request(rng: np.random.Generator, rid: str) -> Request:
  n = int(rng.choice([1, 2, 7, 16, 17, 31, 33, 60, 95]) if rng.random() < 0.4 else rng.integers(1, 100))
  sampled = rng.random() < 0.35
  return Request(
    rid,
    rng.integers(0, 512, n).tolist(),
    int(rng.integers(1, 61)),
    temperature=float(rng.choice([0.7, 1.0, 1.3])) if sampled else 0.0,
    top_k=int(rng.choice([0, 5, 50])) if sampled else 0,
    top_p=float(rng.choice([1.0, 0.9])) if sampled else 1.0,
    seed=int(rng.integers(0, 2**31)),
    stop_token_ids=tuple(int(t) for t in rng.integers(0, 512, int(rng.integers(0, 4)))),
    stop=(
      tuple(str(x) for x in rng.choice(STOP_STRINGS, int(rng.integers(1, 3)), replace=False))
      if rng.random() < 0.15
      else ()
    ),
    include_stop_str_in_output=bool(rng.random() < 0.5),
    ignore_eos=bool(rng.random() < 0.5),
  )


def workload(seed: int, requests: int = 24) -> list[Planned]:
  """``requests`` planned requests: arrivals spread over the first steps (bursts included), about a fifth aborted
  between steps at a random later step, a tenth from their own on_token callback; 3% have a callback that raises;
  a tenth are submitted from an earlier request's callback."""
  rng = np.random.default_rng(seed)
  plan, step = [], 0
  for i in range(requests):
    step += int(rng.choice([0, 0, 1, 2, 5]))
    p = Planned(random_request(rng, f"s{seed}-r{i}"), step)
    p.imported = p.request.temperature == 0 and rng.random() < 0.2  # (its first token is the prefill's argmax)
    u = rng.random()
    if u < 0.2:
      p.abort_step = step + int(rng.integers(0, 30))
    elif u < 0.3:
      p.abort_after_tokens = int(rng.integers(1, 8))
    elif u < 0.33:
      p.raise_after_tokens = int(rng.integers(1, 8))
    if i and rng.random() < 0.1:
      p.parent = int(rng.integers(0, i))
      p.arrive_step = max(p.arrive_step, plan[p.parent].arrive_step)
    plan.append(p)
  return plan


class CallbackFailed(RuntimeError):
  """What a planned on_token callback raises."""


# What a request asks for (its results and callback aside): what an alone run repeats.
INPUT_FIELDS = (
  "prompt_ids",
  "max_new_tokens",
  "temperature",
  "top_k",
  "top_p",
  "seed",
  "stop_token_ids",
  "stop",
  "include_stop_str_in_output",
  "ignore_eos",
)


def inputs(r: Request) -> dict:
  """r's INPUT_FIELDS, hashable (prompt a tuple, stop token ids sorted)."""
  return {
    **{f: getattr(r, f) for f in INPUT_FIELDS},
    "prompt_ids": tuple(r.prompt_ids),
    "stop_token_ids": tuple(sorted(r.stop_token_ids)),
  }


def fresh(r: Request) -> Request:
  """A new Request with r's id and inputs (no callback, no prompt KV)."""
  return Request(r.request_id, **{**inputs(r), "prompt_ids": list(r.prompt_ids)})


def run(
  engine: Engine, references: References, plan: list[Planned], seed: int, max_steps: int = 5000
) -> dict[str, str]:
  """Steps the workload on ``engine``; returns how each request ended ("step", "abort", or "refused": the queue
  was full or the request larger than the pools) and checks, on the way, that refused submissions raise and that
  nothing ends twice, or with an error its callback did not raise."""
  rng = np.random.default_rng(seed + 10**6)
  pin_rng = np.random.default_rng(seed + 2 * 10**6)  # (its own stream: the one-device workloads stay the same)
  # Odd seeds' workloads come from three clients (fair queueing, preemption for a client holding no slot); even
  # seeds' from one, scheduled in arrival order as before clients existed.
  client_rng = np.random.default_rng(seed + 3 * 10**6)
  clients = seed % 2 == 1
  ended: dict[str, str] = {}
  by_id = {p.request.request_id: p for p in plan}
  live: list[Request] = []
  submitted: set[str] = set()

  def submit(p: Planned) -> None:
    submitted.add(p.request.request_id)
    if p.imported:
      references.export(engine, p.request)
    if engine.groups > 1 and pin_rng.random() < 0.25:  # pinned to a DP group, as a prefill server's requests are
      p.request.dp_group = int(pin_rng.integers(engine.groups))
    if clients:
      p.request.client = str(client_rng.choice(["a", "b", "c"]))
    full = (
      engine.max_queued_requests is not None
      and len(engine.waiting) >= engine.max_queued_requests + engine.backend.free_slots
    )
    try:
      engine.submit(p.request)
    except ResourceExhausted as e:  # the queue is full, or the request needs more KV than the pools hold
      assert full or "queue full" not in str(e), f"seed {seed}: {p.request.request_id} refused: {e}"
      ended[p.request.request_id] = "refused"
      return
    assert not full, f"seed {seed}: {p.request.request_id} accepted with the queue full"
    live.append(p.request)

  for i, p in enumerate(plan):
    children = [c for c in plan if c.parent == i]

    def on_token(_tok, _text, p=p, children=children):
      n = len(p.request.output_ids)
      for c in children:
        if c.request.request_id not in submitted:
          submit(c)
      if p.abort_after_tokens is not None and n >= p.abort_after_tokens:
        engine.abort(p.request.request_id)
      if p.raise_after_tokens is not None and n >= p.raise_after_tokens:
        raise CallbackFailed(f"planned failure of {p.request.request_id}")

    p.request.on_token = on_token
  step = 0
  while len(submitted) < len(plan) or engine.has_work():
    assert step < max_steps, f"seed {seed}: no progress after {max_steps} steps ({engine.loads()})"
    for p in plan:
      if (
        p.arrive_step <= step
        and p.request.request_id not in submitted
        and (p.parent is None or plan[p.parent].request.done or plan[p.parent].request.request_id in ended)
      ):
        submit(p)  # (a child whose parent ended without a token: now)
      if p.abort_step == step and p.request in live and p.request.request_id not in ended:
        got = engine.abort(p.request.request_id)
        assert got is p.request and got.finish_reason == "abort", (seed, p.request.request_id, got)
        ended[p.request.request_id] = "abort"
    if rng.random() < 0.1:  # refused submissions change nothing
      before = (len(engine.waiting), len(engine.running))
      bad = rng.integers(0, 3)
      if bad == 0:
        req, error = Request(f"s{seed}-long{step}", [1] * MAX_SEQ_LEN, 4), (InvalidRequest, ResourceExhausted)
      elif bad == 1 and [r for r in live if r.request_id not in ended]:
        req, error = fresh(next(r for r in live if r.request_id not in ended)), InvalidRequest  # id in use
      else:
        req, error = Request(f"s{seed}-empty{step}", [], 4), InvalidRequest
      try:
        engine.submit(req)
      except error:
        pass
      else:
        raise AssertionError(f"seed {seed}: {req.request_id} ({len(req.prompt_ids)} tokens) was accepted")
      assert (len(engine.waiting), len(engine.running)) == before
    if engine.has_work():
      assert all(r.dp_group in (None, r.kv.group) for r in engine.running), f"seed {seed}: a pinned request moved"
      for r in engine.step():
        assert r.request_id in by_id, (seed, r.request_id)
        assert r.request_id not in ended, f"seed {seed}: {r.request_id} ended twice"
        if by_id[r.request_id].raise_after_tokens is not None and r.finish_reason == "error":
          assert "planned failure" in r.error, (seed, r.request_id, r.error)
        else:
          assert r.finish_reason not in (None, "error"), (seed, r.request_id, r.finish_reason, r.error)
        ended[r.request_id] = "step"
    for p in plan:  # an abort from on_token: step() does not return the request
      r = p.request
      if r.finish_reason == "abort" and r.request_id not in ended:
        ended[r.request_id] = "abort"
    step += 1
  return ended


def check(
  engine: Engine,
  references: References,
  plan: list[Planned],
  ended: dict[str, str],
  seed: int,
  preemptions_before: int = 0,
) -> None:
  """The contract in the module docstring; ``preemptions_before``: the engine's count before the workload."""
  loads = engine.loads()
  assert all_kv_free(loads) and loads["queued"] == 0 and loads["resident"] == 0, (seed, loads)
  assert engine.num_preemptions - preemptions_before == sum(p.request.num_preemptions for p in plan), seed
  for p in plan:
    r = p.request
    assert ended.get(r.request_id) is not None, f"seed {seed}: {r.request_id} never ended"
    alone = references.alone(engine, r)
    want, reason = alone.output_ids, alone.finish_reason
    where = (
      f"seed {seed}, {r.request_id} ({len(r.prompt_ids)}-token prompt{', imported' if p.imported else ''}, "
      f"{r.max_new_tokens} new, temperature {r.temperature}, stop {r.stop}, preempted {r.num_preemptions}x)"
    )
    if ended[r.request_id] == "refused":
      assert not r.output_ids and r.finish_reason is None, where
    elif r.finish_reason in ("abort", "error"):  # (error: its callback raised)
      assert r.output_ids == want[: len(r.output_ids)], f"{where}: aborted with {r.output_ids}, alone {want}"
    else:
      assert (r.output_ids, r.finish_reason, r.matched_stop, r.text) == (
        want,
        reason,
        alone.matched_stop,
        alone.text,
      ), f"{where}: {r.finish_reason} {r.output_ids} {r.text!r}, alone {reason} {want} {alone.text!r}"


def fuzz(name: str, seeds, requests: int = 24, references: References | None = None, log=None) -> dict:
  """Runs and checks ``workload(seed)`` for each seed on one engine of configuration ``name``; returns totals."""
  engine = make_engine(name)
  references = references or References()
  totals = dict(
    requests=0,
    aborted=0,
    refused=0,
    imported=0,
    callback_errors=0,
    from_callbacks=0,
    preemptions=0,
    offloads=0,
    misses=0,
    pinned=0,
    fairness_preemptions=0,
  )
  for seed in seeds:
    pre, off, fair = engine.num_preemptions, engine.num_offloads, engine.num_fairness_preemptions
    plan = workload(seed, requests)
    ended = run(engine, references, plan, seed)
    check(engine, references, plan, ended, seed, pre)
    totals["requests"] += len(plan)
    totals["aborted"] += sum(v == "abort" for v in ended.values())
    totals["refused"] += sum(v == "refused" for v in ended.values())
    totals["imported"] += sum(p.imported for p in plan)
    totals["callback_errors"] += sum(p.request.finish_reason == "error" for p in plan)
    totals["from_callbacks"] += sum(p.parent is not None for p in plan)
    totals["preemptions"] += engine.num_preemptions - pre
    totals["offloads"] += engine.num_offloads - off
    totals["misses"] += sum(p.request.misses for p in plan)
    totals["pinned"] += sum(p.request.dp_group is not None for p in plan)
    totals["fairness_preemptions"] += engine.num_fairness_preemptions - fair
    if log:
      log(f"{name} seed {seed}: ok ({totals})")
  if engine.groups > 1:
    check_exports(engine, references)
  return totals


def check_exports(engine: Engine, references: References) -> None:
  """A prefill server's export from each DP group (its requests pinned there): the prompt KV sits on the group's
  first device, and its rows and first token equal the reference's export (one device, same KV dtype and TP)."""
  prompt = list(range(3, 40))
  want = Request("want", prompt, 1)
  references.export(engine, want)
  for group in range(engine.groups):
    ex = Request(f"export-{group}", prompt, 1, export_kv=True, ignore_eos=True, dp_group=group)
    engine.submit(ex)
    engine.run()
    assert ex.output_ids == [want.first_token], (group, ex.output_ids, want.first_token)
    for got, ref in zip(ex.prompt_kv, want.prompt_kv):
      assert got.devices() == {engine.runner.group_device(group)}, (group, got.devices())
      np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=f"group {group}")
  assert all_kv_free(engine.loads()), engine.loads()


def seed_range(text: str) -> list[int]:
  lo, _, hi = text.partition("-")
  return list(range(int(lo), int(hi or lo) + 1))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
  ap.add_argument("--seeds", type=seed_range, default=list(range(20)), help="N or N-M (inclusive)")
  ap.add_argument("--requests", type=int, default=24, help="requests per workload")
  args = ap.parse_args(argv)
  names = args.configs.split(",")
  if unknown := [n for n in names if n not in CONFIGS]:
    ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
  references = References()
  for name in names:
    t0 = time.perf_counter()
    totals = fuzz(name, args.seeds, args.requests, references, log=lambda s: print(s, flush=True))
    print(f"{name}: {len(args.seeds)} workloads passed in {time.perf_counter() - t0:.0f} s: {totals}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
