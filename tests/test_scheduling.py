"""The engine as a scheduler: chunked prefill interleaved with decode, batch buckets, paging, preemption."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, InvalidRequest, Request, ResourceExhausted, StartupError
from tests import engine_fuzz
from tests.fake_runner import FakeRunner
from tests.tiny_model import TINY_HISPARSE, all_kv_free, tiny_model_dir
from tests.xla_env import with_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = dict(page_size=16, chunked_prefill_size=32)
# Scheduling alone: the fake runner's tokens read the KV back through the engine's page tables (tests/fake_runner.py).
FAKE = dict(runner_class=FakeRunner)


def prompt(n, seed=0):
  return np.random.default_rng(seed).integers(2, 512, n).tolist()


@pytest.mark.parametrize("hisparse", [None, HiSparseConfig(**TINY_HISPARSE)], ids=["dense", "hisparse"])
def test_long_prompt_prefills_in_chunks_while_running_requests_keep_decoding(hisparse):
  eng = Engine(
    tiny_model_dir(), hisparse=hisparse, max_running_requests=4, max_seq_len=320, deterministic=True, **SMALL
  )
  running = Request("running", prompt(20), 40)
  eng.submit(running)
  eng.step()
  long = Request("long", prompt(200, 1), 4)
  eng.submit(long)
  steps = 0
  while not long.output_ids:
    before = len(running.output_ids)
    eng.step()
    steps += 1
    assert len(running.output_ids) == before + 1  # one token every step, prefill or not
  assert steps == 200 // 32 + 1 and eng.prefill_calls == 1 + 7  # 7 chunks of at most 32 tokens
  eng.run()
  # Chunking and interleaving change nothing: the same tokens as each request alone.
  for r in (running, long):
    alone = Request("alone", r.prompt_ids, r.max_new_tokens)
    eng.submit(alone)
    eng.run()
    assert alone.output_ids == r.output_ids
  assert all_kv_free(eng.loads())


def test_decode_batch_is_a_bucket_of_the_running_requests():
  # (Overlapped, requests whose prefill ends join the decode a step later: the plain schedule here.)
  eng = Engine(tiny_model_dir(), max_running_requests=8, max_seq_len=128, overlap_schedule=False, **SMALL, **FAKE)
  reqs = [Request(str(i), prompt(10, i), 3) for i in range(3)]
  eng.submit(reqs[0])
  eng.step()
  assert eng.last_decode_batch == 1
  for r in reqs[1:]:
    eng.submit(r)
  eng.step()
  assert eng.last_decode_batch == 4  # 3 running -> bucket 4, not the 8 slots
  eng.run()
  det = Engine(tiny_model_dir(), max_running_requests=8, max_seq_len=128, deterministic=True, **SMALL, **FAKE)
  det.submit(Request("x", prompt(10), 3))
  det.step()
  assert det.last_decode_batch == 8  # deterministic: always the full batch


def _prefill_shapes(eng) -> list:
  """The [B, C] token shape of each prefill call the engine makes from now on (a list it appends to)."""
  shapes, call = [], eng.runner.prefill

  def record(tokens, *args, **kwargs):
    shapes.append(tuple(np.shape(tokens)))
    return call(tokens, *args, **kwargs)

  eng.runner.prefill = record
  return shapes


def test_a_prefill_call_computes_at_most_the_chunk_budget_of_padded_slots():
  """A prefill call computes a [B, C] bucket (B rows a power of two, C the power of two covering the longest
  row): a prompt whose row would grow it past --chunked-prefill-size waits for the next step, in order."""
  eng = Engine(tiny_model_dir(), max_running_requests=8, max_seq_len=128, **SMALL, **FAKE)  # 32 tokens per step
  shapes = _prefill_shapes(eng)
  # 3 prompts of 10 tokens fit the 32-token budget, but as 4 rows x 16 columns = 64 slots: two go first.
  reqs = [Request(str(i), prompt(10, i), 2) for i in range(3)]
  for r in reqs:
    eng.submit(r)
  eng.step()
  assert shapes == [(2, 16)] and [bool(r.output_ids) for r in reqs] == [True, True, False]
  eng.run()
  assert shapes == [(2, 16), (1, 16)]
  # A 28-token prompt (32 columns) and a 4-token one: 2 x 32 slots would be 64; the short one goes next.
  long, short = Request("long", prompt(28, 5), 2), Request("short", prompt(4, 6), 2)
  eng.submit(long)
  eng.submit(short)
  eng.run()
  assert shapes[2:] == [(1, 32), (1, 16)]
  assert all(b * c <= 32 for b, c in shapes)
  for r in reqs + [long, short]:  # the same tokens as each request alone
    alone = Request("alone", r.prompt_ids, r.max_new_tokens)
    eng.submit(alone)
    eng.run()
    assert alone.output_ids == r.output_ids


def test_a_short_prompt_is_not_held_behind_a_long_prefill():
  """A short prompt that arrives while a long one prefills gets its first token at the next step: it goes first
  and the long prompt computes a shorter chunk beside it in the same bucket, still within the chunk budget."""
  eng = Engine(tiny_model_dir(), max_running_requests=4, max_seq_len=320, overlap_schedule=False, **SMALL, **FAKE)
  shapes = _prefill_shapes(eng)
  long, short = Request("long", prompt(200, 1), 3), Request("short", prompt(4, 2), 3)
  eng.submit(long)
  eng.step()
  assert shapes == [(1, 32)] and long.prefilled == 32
  eng.submit(short)
  eng.step()
  assert short.output_ids and not long.output_ids  # the short one's first token, the long one still prefilling
  assert shapes[1] == (2, 16) and long.prefilled == 48
  eng.run()
  assert all(b * c <= 32 for b, c in shapes) and len(long.output_ids) == 3
  for r in (long, short):  # the same tokens as each request alone
    alone = Request("alone", r.prompt_ids, r.max_new_tokens)
    eng.submit(alone)
    eng.run()
    assert alone.output_ids == r.output_ids


DP_PREFILL = """
import numpy as np
from hisparse_jax.engine import Engine, Request
from tests.tiny_model import tiny_model_dir
eng = Engine(tiny_model_dir(), dp_size=2, max_running_requests=4, max_seq_len=128, page_size=16,
             chunked_prefill_size=32)
shapes, call = [], eng.runner.prefill_fn
def record(params, tokens, *args, **kwargs):
  shapes.append(tuple(tokens.shape))
  return call(params, tokens, *args, **kwargs)
eng.runner.prefill_fn = record
a = Request("a", np.arange(2, 22).tolist(), 8)
b = Request("b", np.arange(30, 38).tolist(), 8)
eng.submit(a)
eng.submit(b)
eng.step()
print(shapes, a.kv.group, b.kv.group, b.prefilled)
"""


def test_a_prefill_row_in_another_dp_groups_padding_goes_in_the_same_call():
  """With 2 DP groups every prefill call has a row per group: a 20-token prompt's call is [2, 32], over the
  32-token budget by itself; an 8-token prompt of the other group fills its padding row in that call."""
  r = subprocess.run(
    [sys.executable, "-c", DP_PREFILL],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "XLA_FLAGS": with_devices(2)},
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.split("\n")[-2] == "[(2, 32)] 0 1 8"


def test_memory_follows_tokens_and_max_seq_len_defaults_to_the_model():
  # (Overlapped steps take the next token's page a step earlier: the counts below are the plain schedule's.)
  eng = Engine(tiny_model_dir(), max_running_requests=4, overlap_schedule=False, **SMALL, **FAKE)
  assert eng.max_seq_len == eng.config.max_position_embeddings == 512
  kv = lambda: next(p for p in eng.loads()["pools"] if p["name"] == "kv")
  free0 = kv()["pages_free"]
  assert free0 == 4 * 32  # never more pages than max_running_requests x max_seq_len could fill
  r = Request("r", prompt(40), 30)
  eng.submit(r)
  while r.seq_len < 49:  # prefill (2 chunks of <= 32), then decode up to position 47
    eng.step()
    assert free0 - kv()["pages_free"] == 3  # 41 tokens reserved at admission: 3 pages of 16
  eng.step()  # feeds position 48: a fourth page
  assert free0 - kv()["pages_free"] == 4
  eng.run()
  assert kv()["pages_free"] == free0


def test_a_request_runs_once_and_bad_fields_or_callbacks_fail_it_alone():
  """The Python API's misuses (a new user's findings): the same Request submitted twice (it decoded wrong
  tokens and then the engine spun forever), a finished one resubmitted (it extended its old output), fields of
  the wrong type (2.5 tokens, float or bool ids, a str prompt), and an on_token callback that raises (it took
  every later step down): each is that request's error, and the engine goes on."""
  eng = Engine(tiny_model_dir(), max_running_requests=4, max_seq_len=128, deterministic=True, **SMALL, **FAKE)
  ref = Request("ref", prompt(20), 6)
  eng.submit(ref)
  eng.run()
  r = Request("twice", prompt(20), 6)
  eng.submit(r)
  with pytest.raises(InvalidRequest, match="'twice' was already submitted"):
    eng.submit(r)
  eng.run()
  assert r.output_ids == ref.output_ids and not eng.has_work()
  with pytest.raises(InvalidRequest, match="already submitted"):
    eng.submit(r)  # finished: not extended
  assert r.output_ids == ref.output_ids
  for bad, message in (
    (Request("a", prompt(5), 2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    (Request("b", [0.0, 5.5], 2), "prompt_ids must be token ids \\(int\\), got 0.0"),
    (Request("c", [True, 5], 2), "got True"),
    (Request("d", "Hello world", 2), "got str \\(a text prompt is tokenized first"),
    (Request("e", prompt(5), 2, temperature="0"), "temperature must be a number"),
    (Request("f", prompt(5), 2, top_k=1.5), "top_k and seed must be integers"),
    (Request("g", prompt(5), 2, top_k=2**31), "top_k must be in \\[0, 2147483647\\]"),
    (Request("h", prompt(5), 2, temperature=1.0, top_p=1e-45), "below float32's smallest normal"),
    (Request("i", prompt(5), 2, temperature=1e300), "overflows float32"),
    (Request("j", {1: 2}, 2), "prompt_ids must be a list"),
    (Request("k", {3, 4}, 2), "prompt_ids must be a list"),
    (Request("l", prompt(5), 2, output_ids=[5, 5]), "output_ids, text and finish_reason"),
    (Request("m", prompt(5), 2, finish_reason="abort"), "output_ids, text and finish_reason"),
    (Request("n", prompt(5), 2, temperature=10**400), "temperature overflows float32"),
    (Request("o", prompt(5), 2, ignore_eos="no"), "ignore_eos must be True or False"),
    (Request("p", prompt(5), 2, on_token="print"), "on_token must be callable"),
    (Request(None, prompt(5), 2), "request_id must be a string, got NoneType"),
    (Request("q", prompt(5), 2, dp_group=1), "dp_group must be None or a DP group in \\[0, 1\\), got 1"),
    (Request("r", prompt(5), 2, dp_group=True), "dp_group must be None or a DP group"),
  ):
    with pytest.raises(InvalidRequest, match=message):
      eng.submit(bad)
  import types

  eng.lockstep = types.SimpleNamespace(is_leader=True)  # as on process 0 of several (only validate reads it here)
  with pytest.raises(InvalidRequest, match="export_kv \\(a prefill server's request\\) needs an engine of one"):
    eng.submit(Request("s", prompt(5), 1, export_kv=True))
  eng.lockstep = None
  assert not eng.has_work() and all_kv_free(eng.loads()) and eng.loads()["free_lanes"] == 4  # nothing held
  assert eng.submit(Request("np", list(np.asarray(prompt(5), np.int64)), 2)) is None  # numpy ints are ids
  eng.run()
  # A request_id is unique among unfinished requests (abort(id) names one), and free again once it ends.
  eng.submit(Request("dup", prompt(5), 20))
  with pytest.raises(InvalidRequest, match="request_id 'dup' is already in use"):
    eng.submit(Request("dup", prompt(5), 2))
  eng.step()
  with pytest.raises(InvalidRequest, match="already in use"):
    eng.submit(Request("dup", prompt(5), 2))  # (running now)
  eng.run()
  eng.submit(Request("dup", prompt(5), 2))
  assert eng.abort("dup").finish_reason == "abort"
  eng.submit(Request("dup", prompt(5), 2))
  eng.run()

  def boom(token, delta):
    raise RuntimeError("user callback boom")

  bad, good = Request("boom", prompt(20), 6, on_token=boom), Request("good", prompt(20), 6)
  eng.submit(bad)
  eng.submit(good)
  eng.run()
  assert bad.finish_reason == "error" and "on_token raised RuntimeError: user callback boom" in bad.error
  assert good.output_ids == ref.output_ids and all_kv_free(eng.loads())

  # A KeyboardInterrupt from on_token ends its request and reaches the caller once the step is complete; a
  # step() from inside on_token is refused (it would interleave two steps' state); the engine goes on.
  def interrupt(token, delta):
    raise KeyboardInterrupt

  def reenter(token, delta):
    eng.step()

  for callback, raised, message in (
    (interrupt, KeyboardInterrupt, "KeyboardInterrupt"),
    (reenter, None, "RuntimeError: Engine.step() called inside a step"),
  ):
    bad, good = Request("cb", prompt(20), 6, on_token=callback), Request("good", prompt(20), 6)
    eng.submit(bad)
    eng.submit(good)
    if raised is not None:
      with pytest.raises(raised):
        eng.run()
    eng.run()
    assert bad.finish_reason == "error" and message in bad.error, bad.error
    assert good.output_ids == ref.output_ids and all_kv_free(eng.loads())


@pytest.mark.parametrize("hisparse", [None, HiSparseConfig(**TINY_HISPARSE)], ids=["dense", "hisparse"])
def test_an_abort_from_on_token_takes_effect_after_its_step(hisparse):
  """An on_token callback that aborts another request while that one is being prefilled in the same step (its
  row is still being computed: the abort crashed the step with an AttributeError), or aborts its own request:
  the abort is applied once the step is complete, neither comes back from step() (abort() returned it), no
  on_token runs for them after the abort, and the other requests get the tokens they get alone."""
  eng = Engine(
    tiny_model_dir(), max_running_requests=4, max_seq_len=128, deterministic=True, hisparse=hisparse, **SMALL, **FAKE
  )
  ref = Request("ref", prompt(20), 4)
  eng.submit(ref)
  eng.run()
  after_abort = []
  for target in ("b", "a"):

    def cb(token, delta, target=target):
      if len(a.output_ids) == 1:
        assert eng.abort(target) is {"a": a, "b": b}[target]

    a = Request("a", prompt(20), 4, on_token=cb)
    b = Request("b", prompt(20), 4, on_token=lambda token, delta: after_abort.append(token))
    eng.submit(a)
    eng.submit(b)
    returned = []
    while eng.has_work():
      returned += eng.step()
    aborted, other = (b, a) if target == "b" else (a, b)
    assert aborted.finish_reason == "abort" and aborted not in returned and all_kv_free(eng.loads())
    assert other.finish_reason == "length" and other.output_ids == ref.output_ids and returned == [other]
    if target == "b":
      assert not after_abort  # b's first token came in the step that aborted it: no callback for it
    after_abort.clear()


def test_a_step_that_did_not_complete_needs_a_reset():
  """A KeyboardInterrupt (or any exception) that escapes step() leaves its state half-updated: later steps are
  refused with a RuntimeError naming reset() (they went on to give a request 60 tokens of its 20, silently), and
  after reset() the engine serves as before. The engine keeps its own copy of a prompt: a caller's list changed
  after submit changes nothing."""
  eng = Engine(tiny_model_dir(), max_running_requests=2, max_seq_len=128, **SMALL, **FAKE)
  ref = Request("ref", prompt(20), 4)
  eng.submit(ref)
  eng.run()
  ids = prompt(20)
  r = Request("r", ids, 4)
  eng.submit(r)
  ids[:] = [7] * 60  # the caller's list, after submit
  decode = eng._decode

  def interrupted(finished):
    raise KeyboardInterrupt

  eng._decode = interrupted
  with pytest.raises(KeyboardInterrupt):
    eng.step()
  eng._decode = decode
  with pytest.raises(RuntimeError, match=r"a previous step did not complete \(KeyboardInterrupt\).*Engine.reset\(\)"):
    eng.step()
  assert eng.reset() == [r] and r.finish_reason == "error"
  again = Request("again", ids[:0] + prompt(20), 4)
  eng.submit(again)
  eng.run()
  assert again.output_ids == ref.output_ids
  r2 = Request("r2", ids := prompt(20), 4)
  eng.submit(r2)
  ids.clear()
  eng.run()
  assert r2.output_ids == ref.output_ids and r2.prompt_ids == prompt(20)


def test_requests_that_never_fit_or_exceed_the_context_fail_alone():
  eng = Engine(
    tiny_model_dir(), max_running_requests=2, max_seq_len=300, max_device_kv_bytes=6 * 16 * 768, **SMALL, **FAKE
  )
  assert eng.memory_plan.pools["kv"][1] == 6  # 96 tokens of KV
  with pytest.raises(InvalidRequest, match="exceeds the model context of 300 tokens"):
    eng.submit(Request("long", prompt(290), 20))
  with pytest.raises(ResourceExhausted, match="needs 7 pages of the kv pool"):
    eng.submit(Request("big", prompt(90), 20))
  ok = Request("ok", prompt(60), 20)
  eng.submit(ok)
  eng.run()
  assert len(ok.output_ids) == 20 and all_kv_free(eng.loads())


@pytest.mark.parametrize("hisparse", [None, HiSparseConfig(**TINY_HISPARSE)], ids=["dense", "hisparse"])
def test_pool_exhaustion_preempts_and_recovers(hisparse):
  """A burst of long requests on a pool that holds ~2 of them: some are preempted (pages freed, re-queued,
  recomputed), all finish, the free page counts return to the baseline."""
  eng = Engine(
    tiny_model_dir(),
    hisparse=hisparse,
    max_running_requests=4,
    max_seq_len=128,
    max_device_kv_bytes=(300_000 if hisparse else 12 * 16 * 768),
    deterministic=True,
    **SMALL,
  )
  base = eng.loads()
  reqs = [Request(str(i), prompt(30, i), 60) for i in range(5)]
  for r in reqs:
    eng.submit(r)
  eng.run()
  assert all(r.finish_reason == "length" and len(r.output_ids) == 60 for r in reqs)
  assert eng.num_preemptions > 0 and sum(r.num_preemptions for r in reqs) == eng.num_preemptions
  assert eng.loads()["pools"] == base["pools"] and all_kv_free(eng.loads())
  # The same requests one at a time (no memory pressure): the preempted ones were recomputed exactly here.
  for r in reqs:
    alone = Request("alone", r.prompt_ids, 60)
    eng.submit(alone)
    eng.run()
    assert alone.output_ids == r.output_ids, r.request_id


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(chunked_prefill_size=0), "--chunked-prefill-size must be > 0"),
    (dict(page_size=16, chunked_prefill_size=40), "--page-size 16 does not divide --chunked-prefill-size 40"),
    (dict(max_device_kv_bytes=1000), "smaller than one page"),
    (dict(max_seq_len=513), "--max-seq-len 513"),
  ],
)
def test_bad_engine_settings_name_the_flag(overrides, message):
  with pytest.raises(StartupError, match=message):
    Engine(tiny_model_dir(), **overrides)


def test_prompt_kv_computed_elsewhere_is_imported_and_decoded():
  """A request arriving with its prompt's KV and first token (as from a prefill server) decodes from them: the
  same tokens in dense and HiSparse mode, and as a continuation of the same KV through the contiguous cache."""
  import jax.numpy as jnp

  from models.deepseek_v32 import decode_step, prefill_prompts, split_model
  from models.loader import load_hf

  cfg, model = load_hf(tiny_model_dir())
  p = prompt(45, 3)
  logits, cache = prefill_prompts(model, jnp.asarray([p]), jnp.asarray([len(p)]), max_len=64)
  kv = (np.asarray(cache.latent[:, 0, :45]), np.asarray(cache.index_key[:, 0, :45]))
  first = int(np.argmax(logits[0, -1]))
  graphdef, state = split_model(model)
  want = [first]
  for pos in range(45, 52):
    lg, cache = decode_step(graphdef, state, jnp.asarray([want[-1]]), jnp.asarray([pos]), cache, key_block=32)
    want.append(int(np.argmax(lg[0])))
  for hisparse in (None, HiSparseConfig(**TINY_HISPARSE)):
    eng = Engine(tiny_model_dir(), hisparse=hisparse, max_running_requests=2, max_seq_len=128, **SMALL)
    r = Request("imported", p, 8, prompt_kv=kv, first_token=first)
    eng.submit(r)
    eng.run()
    assert r.output_ids == want and eng.prefill_calls == 0
    assert all_kv_free(eng.loads())
    with pytest.raises(InvalidRequest, match="prompt_kv shapes"):  # KV of fewer positions than the prompt
      eng.submit(Request("bad", p + [3] * 5, 8, prompt_kv=kv, first_token=first))
    with pytest.raises(InvalidRequest, match="first generated token"):
      eng.submit(Request("bad", p, 8, prompt_kv=kv))
    for bad_kv, bad_first, message in (
      ((kv[0].astype("U1"), kv[1]), first, "prompt_kv dtypes <U1, float32; expected float32, float32"),
      ((kv[0].astype(np.int8), kv[1]), first, "prompt_kv dtypes int8"),
      ([kv[0], kv[1], kv[1]], first, "prompt_kv must be \\(latent, indexer keys\\): two arrays"),
      ((None, None), first, "two arrays"),
      (kv, "5", "first generated token"),
      (kv, 5.7, "first generated token"),
    ):
      with pytest.raises(InvalidRequest, match=message):
        eng.submit(Request("bad", p, 8, prompt_kv=bad_kv, first_token=bad_first))
    assert not eng.has_work() and all_kv_free(eng.loads())


@pytest.mark.parametrize("prefill_mode", ["dense", "hisparse"])
def test_exported_prompt_kv_decodes_as_a_colocated_prefill(prefill_mode):
  """A prefill engine's export (export_kv: the prompt KV read from its pages when the prompt ends, padded to a
  power of two) imported into a decode engine of either mode gives the colocated tokens (prompts shorter and
  longer than the hot buffer and than a prefill chunk); the prefill engine's pages all come back."""
  hs = HiSparseConfig(**TINY_HISPARSE)
  prompts = [prompt(5, 1), prompt(20, 2), prompt(45, 3)]  # hot buffer 16, prefill chunks of 32 (SMALL)

  def engine(hisparse):
    return Engine(
      tiny_model_dir(), hisparse=hisparse, max_running_requests=4, max_seq_len=128, deterministic=True, **SMALL
    )

  colocated = engine(None)
  want = [Request(f"c{i}", p, 6) for i, p in enumerate(prompts)]
  for r in want:
    colocated.submit(r)
  colocated.run()
  prefill = engine(hs if prefill_mode == "hisparse" else None)
  exported = [Request(f"p{i}", p, 1, export_kv=True, ignore_eos=True) for i, p in enumerate(prompts)]
  for r in exported:
    prefill.submit(r)
  prefill.run()
  assert all_kv_free(prefill.loads())
  for r, p in zip(exported, prompts):
    latent, index = r.prompt_kv
    assert latent.shape[1] == max(16, 1 << (len(p) - 1).bit_length()) and not np.asarray(latent[:, len(p) :]).any()
  for decode_mode in (None, hs):
    decode = engine(decode_mode)
    got = [
      Request(f"d{i}", p, 6, prompt_kv=r.prompt_kv, first_token=r.output_ids[0])
      for i, (p, r) in enumerate(zip(prompts, exported))
    ]
    for r in got:
      decode.submit(r)
    decode.run()
    assert [r.output_ids for r in got] == [r.output_ids for r in want] and decode.prefill_calls == 0
    assert all_kv_free(decode.loads())


@pytest.mark.parametrize(
  "hisparse",
  [None, HiSparseConfig(**TINY_HISPARSE), HiSparseConfig(**TINY_HISPARSE, resident_fraction=0.5)],
  ids=["dense", "hisparse", "resident"],
)
def test_compiled_steps_update_every_pool_in_place(hisparse):
  """The compiled prefill, decode (each residency), import and offload calls hold no copy of any KV pool (an
  in-place update that XLA cannot prove safe becomes a full copy of the buffer, per layer: the classic hidden
  cost)."""
  import jax
  import jax.numpy as jnp

  eng = Engine(tiny_model_dir(), hisparse=hisparse, max_running_requests=4, max_seq_len=128, **SMALL)
  r = Request("r", prompt(20), 4)
  eng.submit(r)
  eng.step()
  eng.step()
  state = eng.backend.state
  shapes = {
    "{}[{}]".format(str(a.dtype).replace("float", "f").replace("int", "s"), ",".join(map(str, a.shape)))
    for a in jax.tree.leaves(state)
    if a.ndim >= 3
  }
  assert shapes
  decode_tables = {k: jnp.asarray(v) for k, v in eng.backend.decode_tables([r.kv]).items()}
  prefill_tables = {k: jnp.asarray(v) for k, v in eng.backend.prefill_tables([r.kv], [True]).items()}
  sampling = eng._sampling([r.kv.slot])
  tok, pos = jnp.zeros((1, 32), jnp.int32), jnp.arange(32, dtype=jnp.int32)[None]
  cfg = eng.config
  residencies = ["none"] if not eng.backend.residency_on else ["all", "mixed"]
  assert eng.backend.residency([r.kv]) == residencies[0]
  lowered = {
    **{
      f"decode {res}": eng.runner.decode_fn.lower(
        eng.runner.params,
        tok[:, 0],
        pos[:, 0] + 20,
        state,
        decode_tables,
        sampling,
        eng.runner.logits_buffer(1),
        residency=res,
        **eng.runner.index_blocks(1, 1, 20),
      )
      for res in residencies
    },
    **{
      f"prefill first_token={first}": eng.runner.prefill_fn.lower(
        eng.runner.params,
        tok,
        pos,
        state,
        prefill_tables,
        sampling,
        query_block=None,
        first_token=first,
        **eng.runner.index_blocks(1, 32, 31),
      )
      for first in (True, False)
    },
    "import": eng.runner.import_fn.lower(
      state,
      decode_tables,
      jnp.zeros((cfg.num_hidden_layers, 20, cfg.latent_dim)),
      jnp.zeros((cfg.num_hidden_layers, 20, cfg.index_head_dim)),
      jnp.int32(20),
    ),
  }
  if eng.backend.residency_on:
    offload_tables = {k: jnp.asarray(v) for k, v in eng.backend.offload_tables(r.kv).items()}
    lowered["offload"] = eng.runner.offload_fn.lower(state, offload_tables)
  for name, low in lowered.items():
    hlo = low.compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and any(s in line for s in shapes)]
    assert not copies, (name, copies[:3])


@pytest.mark.parametrize("skips", [0, 2])
def test_requests_that_fit_pass_one_that_does_not_a_bounded_number_of_times(skips):
  """A large request that does not fit yet is passed by later small ones at most max_admission_skips times;
  then nothing behind it is admitted until it is (no head-of-line blocking, no starvation). 0: FIFO."""
  eng = Engine(
    tiny_model_dir(),
    max_running_requests=4,
    max_seq_len=128,
    max_device_kv_bytes=8 * 16 * 768,
    max_admission_skips=skips,
    **SMALL,
    **FAKE,
  )
  first = Request("A", prompt(60), 20)
  eng.submit(first)
  eng.step()  # A holds 4 of the 8 pages (+1 reserved for its growth)
  hog = Request("H", prompt(90, 1), 5)
  small = [Request(f"S{i}", prompt(10, 2 + i), 3) for i in range(3)]
  for r in [hog] + small:
    eng.submit(r)
  eng.step()
  assert [r.request_id for r in eng.waiting] == ["H"] + [f"S{i}" for i in range(skips, 3)]
  assert hog.times_passed == skips
  eng.run()
  assert all(r.finish_reason == "length" for r in [first, hog] + small) and all_kv_free(eng.loads())


def test_admission_counts_passes_per_request_and_stops_scanning_at_the_limit():
  """Engine._admit on a stub backend (no model): each blocked request is charged the admissions made after it
  was passed over, whatever its count before; the scan ends at the first request passed max_admission_skips
  times, so nothing behind it is looked at; resident requests' pages are summed once per step."""
  import collections
  import types

  from hisparse_jax.engine.request import Phase

  calls = []

  def pick_group(n, reserve, prefill, reclaimable, only=None):
    assert only is None
    calls.append(n)
    assert reclaimable == [{"staging": 6}]  # three resident requests of 2 pages, the non-resident one not
    return None if n >= 100 else 0

  def admit(n, prefill, group):
    be.free_slots -= 1
    return types.SimpleNamespace(slot=len(calls), group=0, resident=False)

  be = types.SimpleNamespace(
    free_slots=8,
    groups=1,
    residency_on=False,
    pick_group=pick_group,
    admit=admit,
    will_grow=lambda kv, n: 0,
    reclaimable_pages=lambda kvs: [{"staging": 2 * len(list(kvs))}],
  )
  running = [
    types.SimpleNamespace(
      kv=types.SimpleNamespace(resident=i < 3, group=0), phase=Phase.DECODING, prompt_ids=[0], max_new_tokens=1
    )
    for i in range(4)
  ]
  big = [
    types.SimpleNamespace(request_id=f"B{k}", prompt_kv=None, prefill_ids=[0] * 100, times_passed=t, dp_group=None)
    for k, t in enumerate((0, 2))
  ]
  small = [
    types.SimpleNamespace(
      request_id=f"S{k}",
      prompt_kv=None,
      prefill_ids=[0] * 10,
      times_passed=0,
      dp_group=None,
      temperature=0.0,
      top_k=0,
      top_p=1.0,
      seed=0,
      fair_tag=k,
    )
    for k in range(5)
  ]
  waiting = collections.deque([big[0], small[0], big[1]] + small[1:])
  eng = types.SimpleNamespace(
    backend=be,
    running=running,
    waiting=waiting,
    groups=1,
    max_admission_skips=3,
    _temperature={},
    _top_k={},
    _top_p={},
    _seed={},
    _virtual_time=0,
  )
  eng._decoding = lambda: running
  Engine._admit(eng)
  # S0 passes B0; S1 passes B0 and B1, which then has been passed 3 times: S2.. wait and are not looked at.
  assert [r.request_id for r in waiting] == ["B0", "B1", "S2", "S3", "S4"]
  assert (big[0].times_passed, big[1].times_passed) == (2, 3)
  assert calls == [100, 10, 100, 10] and [r.request_id for r in running[4:]] == ["S0", "S1"]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_request_a_kernel_refuses_fails_alone_and_the_rest_stay_exact(overlap):
  """A decoding request's LRU row corrupted on the device: the swap-in leaves that row unchanged and reports it
  in the step's status (read with the tokens, no extra synchronization); the engine ends that request alone
  (finish_reason "error", the kernel's INVALID_ARGUMENT message), frees its pages, and the others' tokens
  equal a run without it. Overlapped, the call launched before the corruption delivers its token first and the
  next step's call reports the error."""
  import dataclasses

  hs = HiSparseConfig(**TINY_HISPARSE)
  prompts = {name: prompt(30, seed) for seed, name in enumerate(("a", "victim", "b"))}  # > D: the slow path
  want = {}
  for name in ("a", "b"):
    eng = Engine(tiny_model_dir(), hisparse=hs, max_running_requests=4, max_seq_len=128, deterministic=True, **SMALL)
    eng.submit(r := Request(name, prompts[name], 6))
    eng.run()
    want[name] = r.output_ids
  eng = Engine(
    tiny_model_dir(),
    hisparse=hs,
    max_running_requests=4,
    max_seq_len=128,
    deterministic=True,
    overlap_schedule=overlap,
    **SMALL,
  )
  reqs = {name: Request(name, p, 6) for name, p in prompts.items()}
  for r in reqs.values():
    eng.submit(r)
  while not all(r.output_ids for r in reqs.values()):
    assert not eng.step()
  victim = reqs["victim"]
  slot = victim.kv.group * (eng.backend.slots_per_group + 1) + eng.backend.local_slot(victim.kv)
  state = eng.backend.state
  last = state.lru.shape[0] - 1  # the last layer: the earlier ones of this step are done for every row
  eng.backend.state = dataclasses.replace(state, lru=state.lru.at[last, slot, 0].set(state.lru[last, slot, 1]))
  emitted = len(victim.output_ids)
  finished = eng.step()
  if overlap:
    assert finished == [] and len(victim.output_ids) == emitted + 1  # the call launched before the corruption
    emitted += 1
    finished = eng.step()
  # (Overlapped, "a" reaches its length in that step too.)
  assert victim in finished and all(r.finish_reason == "length" for r in finished if r is not victim)
  assert victim.finish_reason == "error" and victim.kv is None
  assert len(victim.output_ids) == emitted  # the failed row's token is not emitted
  assert "INVALID_ARGUMENT: decode (swap-in / backup): row" in victim.error
  assert "LRU order is not a permutation" in victim.error
  eng.run()
  assert {n: reqs[n].output_ids for n in ("a", "b")} == want
  assert all_kv_free(eng.loads())


def test_dynamic_residency_is_lossless_and_offloads_under_memory_pressure():
  """resident_fraction > 0: requests stay resident after their prefill (no swap-in: zero hits and misses)
  while staging pages last; with a small device budget they are offloaded to their hot buffers as prompts
  arrive and residents grow (decode batches mix resident and swapped rows). Greedy tokens equal dense KV's in
  both cases, and every page is freed."""
  lens = (30, 5, 70, 17)
  reqs = lambda: [Request(str(i), prompt(n, i), 40, ignore_eos=True) for i, n in enumerate(lens)]

  def run(hisparse, **kw):
    eng = Engine(tiny_model_dir(), hisparse=hisparse, max_running_requests=4, max_seq_len=160, **SMALL, **kw)
    rs = reqs()
    for r in rs:
      eng.submit(r)
    eng.peak_resident = 0
    while eng.has_work():
      eng.step()
      eng.peak_resident = max(eng.peak_resident, eng.loads()["resident"])
    assert all_kv_free(eng.loads()) and eng.loads()["resident"] == 0
    return [r.output_ids for r in rs], rs, eng

  dense, _, _ = run(None)
  roomy = HiSparseConfig(**TINY_HISPARSE, resident_fraction=0.5)
  tokens, rs, eng = run(roomy)
  assert tokens == dense and eng.num_offloads == 0 and eng.peak_resident == len(lens)
  assert eng.residency_steps["all"] > 0 and not eng.residency_steps["none"]
  assert all(r.hits == r.misses == 0 for r in rs)  # every step attended from device pages: no swap-in
  tokens, rs, eng = run(roomy, max_device_kv_bytes=260_000)  # 16 staging pages (256 tokens) for 4 requests
  assert eng.memory_plan.pools["staging"][1] < sum(-(-(n + 40) // 16) for n in lens)
  assert tokens == dense and eng.num_offloads >= 1 and eng.residency_steps["mixed"] > 0
  assert sum(r.misses for r in rs) > 0  # the offloaded ones swapped in
  # What the server shows: GetLoads and the metrics carry the offloads.
  from hisparse_jax.serving.metrics import ServerMetrics
  from hisparse_jax.serving.server import loads_message

  assert loads_message(eng.loads()).offloads == eng.num_offloads
  metrics = ServerMetrics(row_bytes=4)
  metrics.update(eng.loads())
  assert metrics.registry.get_sample_value("hisparse_offloads_total") == eng.num_offloads


def test_decode_logits_buffer_is_donated_per_bucket_and_dropped_on_reset():
  """On one CPU device a decode step writes its [vocab, B] logits into the buffer the previous step at that
  batch bucket returned (donated: that one is deleted), only the current bucket's buffer is kept, and a reset
  drops it, finishing the requests in flight as errors."""
  eng = Engine(tiny_model_dir(), max_running_requests=4, max_seq_len=128, overlap_schedule=False, **SMALL)
  for i, n in enumerate([3, 3, 6, 10]):  # the batch bucket changes as requests join (one prefill a step) and end
    eng.submit(Request(f"r{i}", prompt(20, i), n, ignore_eos=True))
  donated, buckets = [], []
  while eng.waiting or eng.running:
    before = dict(eng.runner.logits_buffers)
    steps = eng.decode_steps
    eng.step()
    if eng.decode_steps == steps:
      continue
    B = eng.last_decode_batch
    buckets.append(B)
    assert list(eng.runner.logits_buffers) == [B] and eng.runner.logits_buffers[B].shape == (eng.config.vocab_size, B)
    if B in before:
      donated.append(before[B].is_deleted() and eng.runner.logits_buffers[B] is not before[B])
  assert buckets[0] == 1 and 2 in buckets and buckets[-1] == 1  # buckets 1 -> 2 -> 1: new buffers each change
  assert len(donated) >= 6 and all(donated)
  assert eng.reset() == [] and eng.runner.logits_buffers == {}
  # A reset with requests in flight finishes them (waiting, then running) as errors and frees everything;
  # the engine then serves new requests.
  reqs = [Request(f"s{i}", prompt(20, i), 8, ignore_eos=True) for i in range(6)]
  for r in reqs:
    eng.submit(r)
  for _ in range(3):
    eng.step()
  running = list(eng.running)
  assert len(running) == 4 and len(eng.waiting) == 2 and eng.runner.logits_buffers
  assert eng.reset() == list(reqs[4:]) + running
  assert all(r.done and r.finish_reason == "error" and "reset" in r.error and r.kv is None for r in reqs)
  assert not eng.has_work() and eng.runner.logits_buffers == {} and all_kv_free(eng.loads())
  again = Request("again", prompt(20, 0), 5, ignore_eos=True)
  eng.submit(again)
  eng.run()
  assert again.finish_reason == "length" and len(again.output_ids) == 5 and all_kv_free(eng.loads())


@pytest.fixture(scope="module")
def fuzz_references():
  return engine_fuzz.References()


@pytest.mark.parametrize("config", ["dense", "resident", "fp8_score_ema"])
def test_random_workloads_give_each_request_its_tokens_alone(config, fuzz_references):
  """tests/engine_fuzz.py: random arrivals (some submitted from another request's on_token, some with prompt KV
  imported from a prefill engine), aborts (between steps and from on_token), callbacks that raise, refused
  submissions, stop tokens and strings, greedy and seeded sampling, under a budget that forces preemption (and
  offloads with residency); every request ends once with the tokens and text it gets decoded alone on dense KV
  (a prefix if aborted or failed), and all KV is freed. Two seeds here; ``python -m tests.engine_fuzz`` runs
  many."""
  totals = engine_fuzz.fuzz(config, seeds=(0, 1), references=fuzz_references)
  # The workloads reach the paths they are for.
  assert totals["aborted"] >= 4 and totals["preemptions"] >= 1 and totals["imported"] >= 1
  assert totals["callback_errors"] >= 1 and totals["from_callbacks"] >= 1
  assert totals["fairness_preemptions"] >= 1  # (seed 1's requests come from three clients)
  assert (totals["misses"] > 0) == (config != "dense")
  assert (totals["offloads"] > 0) == (config == "resident")


def test_random_workloads_on_meshes():
  """The same on a DP mesh of simulated devices (a subprocess), dense and HiSparse with residency: each DP group
  admits, preempts, offloads and imports in its own pools, requests pinned to a group (``Request.dp_group``, as a
  prefill server pins them) stay there, and a prompt KV exported from each group is on that group's first device
  and equals one device's (the command line also runs TP meshes). (A prompt KV
  imported into a dense engine with --dp-size 2 failed inside shard_map: the per-group method's result shapes were
  evaluated outside the group, where the view method it calls started a shard_map of its own over one group's
  arrays.)"""
  env = {**os.environ, "XLA_FLAGS": with_devices(2)}
  configs = ("dp2_dense", "dp2_resident")
  out = subprocess.run(
    [sys.executable, "-m", "tests.engine_fuzz", "--configs", ",".join(configs), "--seeds", "0-1"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
  for name in configs:
    assert f"{name}: 2 workloads passed" in out.stdout, out.stdout
  assert "'imported': 0" not in out.stdout and "'preemptions': 0" not in out.stdout and "'pinned': 0" not in out.stdout
  assert "'offloads': 0" not in out.stdout.split("dp2_resident: ")[1], out.stdout


@pytest.mark.parametrize("hisparse", [None, HiSparseConfig(**TINY_HISPARSE)], ids=["dense", "hisparse"])
def test_clients_take_turns_and_a_starved_client_gets_a_slot(hisparse):
  """Start-time fair queueing between clients (``Request.client``): client a's backlog of 10 requests on 4 slots
  does not delay client b's one, which is admitted at the next step by preempting a's newest request (a holds
  every slot); c's two requests submitted after b's interleave with a's backlog, not behind it. Every request
  gets the tokens it gets alone (the preempted one is recomputed), and all KV comes back."""
  eng = Engine(tiny_model_dir(), hisparse=hisparse, max_running_requests=4, max_seq_len=128, **SMALL)
  backlog = [Request(f"a{i}", prompt(12, i), 6, client="a") for i in range(10)]
  for r in backlog:
    eng.submit(r)
  eng.step()
  assert [r.request_id for r in eng.running] == ["a0", "a1", "a2", "a3"]
  newest = eng.running[-1]
  b = Request("b", prompt(9, 99), 6, client="b")
  eng.submit(b)
  c = [Request(f"c{i}", prompt(7, 50 + i), 6, client="c") for i in range(2)]
  for r in c:
    eng.submit(r)
  # Waiting in turn: b and c0 (each client's first) before a's backlog, c1 with a's next turn.
  assert [r.request_id for r in eng.waiting][:4] == ["b", "c0", "a4", "c1"]
  eng.step()
  assert b in eng.running and newest not in eng.running and newest.num_preemptions == 1
  assert eng.waiting[0] is newest  # right behind b, ahead of the rest of a's backlog
  eng.step()  # c0 holds no slot either: a's next newest makes room (one preemption a step)
  assert c[0] in eng.running
  eng.run()
  for r in [*backlog, b, *c]:
    alone = Request("alone", r.prompt_ids, r.max_new_tokens)
    eng.submit(alone)
    eng.run()
    assert alone.output_ids == r.output_ids, r.request_id
  assert all_kv_free(eng.loads())


def test_one_client_keeps_arrival_order():
  """Requests of one client (or none) queue in arrival order whatever they interleave with: the fair tags of a
  single client are increasing, so nothing is preempted for fairness."""
  eng = Engine(tiny_model_dir(), max_running_requests=2, max_seq_len=128, **SMALL, **FAKE)
  reqs = [Request(str(i), prompt(8, i), 3, client=None if i % 2 else "x") for i in range(6)]
  for r in reqs[:3]:
    eng.submit(r)
  eng.step()
  for r in reqs[3:]:
    eng.submit(r)
  order = [r.request_id for r in eng.waiting]
  eng.run()
  assert eng.num_preemptions <= 1 and order[0] in ("1", "2")
  solo = Engine(tiny_model_dir(), max_running_requests=2, max_seq_len=128, **SMALL, **FAKE)
  same = [Request(str(i), prompt(8, i), 3) for i in range(6)]
  for r in same[:3]:
    solo.submit(r)
  solo.step()
  for r in same[3:]:
    solo.submit(r)
  assert [r.request_id for r in solo.waiting] == ["2", "3", "4", "5"] and solo.num_preemptions == 0


@pytest.mark.parametrize("hisparse", [None, HiSparseConfig(**TINY_HISPARSE)], ids=["dense", "hisparse"])
def test_chunked_prefill_writes_the_kv_and_tokens_of_one_whole_prompt_call(hisparse):
  """Engine-level chunked prefill against an independent computation: the model's own one-call prefill of each
  whole prompt (``prefill_prompts``, contiguous cache) and greedy ``decode_step``. Prompts of 1, one, several and
  many chunks run together, so the scheduler shortens chunks (boundaries inside and at page boundaries, pages of
  32); each request's stored prompt KV (``export_kv``) and its tokens must equal the reference's."""
  import jax.numpy as jnp

  from models.deepseek_v32 import decode_step, prefill_prompts, split_model
  from models.loader import load_hf

  lengths, new = [1, 7, 40, 100, 230], 5
  prompts = [prompt(n, 50 + n) for n in lengths]
  cfg, model = load_hf(tiny_model_dir())
  S = max(lengths)
  padded = jnp.asarray([p + [0] * (S - len(p)) for p in prompts])
  logits, cache = prefill_prompts(model, padded, jnp.asarray(lengths), max_len=S + new)
  want = [[int(np.argmax(logits[i, n - 1]))] for i, n in enumerate(lengths)]
  want_kv = [(np.asarray(cache.latent[:, i, :n]), np.asarray(cache.index_key[:, i, :n])) for i, n in enumerate(lengths)]
  graphdef, state = split_model(model)
  for step in range(new - 1):
    pos = jnp.asarray([n + step for n in lengths])
    lg, cache = decode_step(graphdef, state, jnp.asarray([w[-1] for w in want]), pos, cache, key_block=32)
    for i, w in enumerate(want):
      w.append(int(np.argmax(lg[i])))

  # (--max-seq-len 512: HiSparse's staging pages hold the long prompt and the short ones at once)
  eng = Engine(
    tiny_model_dir(),
    hisparse=hisparse,
    max_running_requests=len(prompts),
    max_seq_len=512,
    page_size=32,
    chunked_prefill_size=64,
  )
  chunks = []  # (request, first position, tokens) of every prefill row
  call = eng._prefill_call

  def recording(rows, finished):
    chunks.extend((req.request_id, req.prefilled, n) for req, n in rows)
    call(rows, finished)

  eng._prefill_call = recording
  reqs = [Request(f"p{n}", p, new, ignore_eos=True, export_kv=True) for n, p in zip(lengths, prompts)]
  # The longest prompt starts alone; two short ones arriving next share its second chunk's call, which
  # shortens its chunk to 16 positions (a boundary inside a page); the rest arrive after.
  for arrive in ([reqs[4]], reqs[:2], reqs[2:4]):
    for r in arrive:
      eng.submit(r)
    eng.step()
  eng.run()
  for r, n, w, (latent, index) in zip(reqs, lengths, want, want_kv):
    assert r.output_ids == w, r.request_id
    np.testing.assert_allclose(np.asarray(r.prompt_kv[0])[:, :n], latent, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(r.prompt_kv[1])[:, :n], index, rtol=1e-4, atol=1e-4)
  per_request = {r.request_id: sum(1 for c in chunks if c[0] == r.request_id) for r in reqs}
  assert per_request["p1"] == per_request["p7"] == 1 and per_request["p230"] >= 4, chunks
  starts = {start for _, start, _ in chunks if start}
  assert any(s % 32 == 0 for s in starts)
  assert any(s % 32 for s in starts), chunks  # a shortened chunk ends inside a page
