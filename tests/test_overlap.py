"""The overlap schedule (``EngineArgs.overlap_schedule``): each decode step is launched before the previous
step's tokens are read, fed those tokens on the device. It must change no token and lose no page."""

import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, Request
from tests.tiny_model import TINY_HISPARSE, all_kv_free, tiny_model_dir

SMALL = dict(page_size=16, chunked_prefill_size=32)


def prompt(n, seed=0):
  return np.random.default_rng(seed).integers(2, 512, n).tolist()


def workload(stop_token=None):
  """Requests of several lengths: three at once, three more arriving mid-run; one sampled; one (``stop``) with a
  stop token."""
  reqs = [Request(f"r{i}", prompt(8 + 9 * i, i), 4 + 5 * i) for i in range(6)]
  reqs[1].temperature, reqs[1].seed = 0.9, 7
  if stop_token is not None:
    reqs[4].stop_token_ids = [stop_token]
  return reqs


def drive(eng, reqs):
  """Runs the workload: reqs[:3] first, the rest after 3 steps. Returns the decode calls launched and those
  launched ahead (``_launch_next``: before the previous call's tokens were read)."""
  call, launch_next, calls, ahead = eng.runner.decode_fn, eng._launch_next, [0], [0]

  def count_call(*args, **kwargs):
    calls[0] += 1
    return call(*args, **kwargs)

  def count_ahead(launched):
    nxt = launch_next(launched)
    ahead[0] += nxt is not None
    return nxt

  eng.runner.decode_fn, eng._launch_next = count_call, count_ahead
  for r in reqs[:3]:
    eng.submit(r)
  steps = 0
  while eng.has_work():
    eng.step()
    steps += 1
    if steps == 3:
      for r in reqs[3:]:
        eng.submit(r)
  eng.runner.decode_fn, eng._launch_next = call, launch_next
  return calls[0], ahead[0]


@pytest.mark.parametrize(
  "hisparse, deterministic",
  [(None, True), (HiSparseConfig(**TINY_HISPARSE), True), (None, False)],
  ids=["dense", "hisparse", "dense-buckets"],
)
def test_overlapped_steps_give_the_tokens_of_steps_without_overlap(hisparse, deterministic):
  """Without --deterministic the rows move between steps as requests come and go (the launched-ahead step's
  tokens are gathered into their new rows on the device)."""

  def engine(overlap):
    return Engine(
      tiny_model_dir(),
      hisparse=hisparse,
      max_running_requests=4,
      max_seq_len=128,
      deterministic=deterministic,
      overlap_schedule=overlap,
      **SMALL,
    )

  plain, overlapped = engine(False), engine(True)
  ref = workload()
  assert drive(plain, ref)[1] == 0  # nothing launched ahead without overlap_schedule
  # A stop token that the request really emits (its 3rd token without a stop), so that the overlapped run has
  # launched a step for it before reading the token that ends it.
  stop = ref[4].output_ids[2]
  want = workload(stop)
  drive(plain, want)
  assert want[4].finish_reason == "stop_token" and len(want[4].output_ids) <= 3
  got = workload(stop)
  calls, ahead = drive(overlapped, got)
  assert [r.output_ids for r in got] == [r.output_ids for r in want]
  assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
  assert all_kv_free(overlapped.loads()) and overlapped._next is None
  # Overlap really happened: most decode calls were launched before the previous call's tokens were read (the
  # others start the run and follow a step that could not launch ahead: every row ending by its length).
  assert ahead >= 0.6 * calls, (ahead, calls)
  if hisparse is not None:  # every request's swap-ins were counted
    assert all(r.hits + r.misses > 0 for r in got)


def test_abort_with_a_step_in_flight_and_preemption_under_overlap():
  """A request aborted while the step after the one being read is already launched with it: its row's token
  is dropped, the others decode on; a pool too small for the burst preempts (the overlapped launch steps back
  to the plain schedule when a page is missing); every request left equals its run alone; every page is freed."""
  eng = Engine(
    tiny_model_dir(),
    max_running_requests=4,
    max_seq_len=128,
    max_device_kv_bytes=12 * 16 * 768,
    deterministic=True,
    overlap_schedule=True,
    **SMALL,
  )
  reqs = [Request(f"r{i}", prompt(30, i), 40) for i in range(5)]
  aborted = []

  def abort_when_in_flight():
    nxt = eng._next
    if not aborted and nxt is not None and reqs[2] in nxt.order:
      assert eng.abort("r2") is reqs[2]
      aborted.append(len(reqs[2].output_ids))

  for r in reqs:
    eng.submit(r)
  while eng.has_work():
    eng.step()
    abort_when_in_flight()
  assert aborted and reqs[2].finish_reason == "abort" and len(reqs[2].output_ids) == aborted[0]
  assert eng.num_preemptions > 0
  assert all(r.finish_reason == "length" and len(r.output_ids) == 40 for i, r in enumerate(reqs) if i != 2)
  assert all_kv_free(eng.loads())
  for r in reqs:
    alone = Request("alone", r.prompt_ids, 40)
    eng.submit(alone)
    eng.run()
    assert alone.output_ids[: len(r.output_ids)] == r.output_ids, r.request_id
  # The last request ending on a stop token with the next call launched: nothing of that call is kept.
  last = Request("last", reqs[0].prompt_ids, 40, stop_token_ids=[reqs[0].output_ids[3]])
  eng.submit(last)
  eng.run()
  assert last.finish_reason == "stop_token" and not eng.has_work() and eng._next is None


def test_a_step_that_fails_with_a_step_in_flight_is_reset_cleanly():
  """A decode launch that raises while the previous call is launched and unread (the step launched ahead):
  step() raises, reset() drops the request and the unread step, and the engine then serves exactly."""
  eng = Engine(tiny_model_dir(), max_running_requests=4, max_seq_len=128, overlap_schedule=True, **SMALL)
  solo = Request("solo", prompt(12, 3), 8)
  eng.submit(solo)
  eng.run()
  r = Request("r", prompt(12, 4), 30)
  eng.submit(r)
  eng.step()
  eng.step()
  launched = eng._next
  assert launched is not None and launched.order[0] is r
  eng.step()
  # The logits buffer passes from call to call (donated; on CPU the [vocab, B] logits are written over it).
  assert launched.logits.is_deleted() and eng._next.logits is not None and not eng._next.logits.is_deleted()
  call = eng.runner.decode_fn

  def failing(*args, **kwargs):
    raise RuntimeError("injected launch failure")

  eng.runner.decode_fn = failing
  with pytest.raises(RuntimeError, match="injected"):
    eng.step()  # takes the call launched last step, and fails launching the next before reading it
  eng.runner.decode_fn = call
  dropped = eng.reset()
  assert dropped == [r] and r.finish_reason == "error" and eng._next is None
  again = Request("again", solo.prompt_ids, 8)
  eng.submit(again)
  eng.run()
  assert again.output_ids == solo.output_ids and all_kv_free(eng.loads())
