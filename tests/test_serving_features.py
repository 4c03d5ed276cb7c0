"""Sampling, stop conditions, Abort / GetLoads RPCs, device-KV admission budget and the queue bound."""

import asyncio
import concurrent.futures
import threading
import time

import grpc
import numpy as np
import pytest

import jax.numpy as jnp

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, Request, RequestError
from hisparse_jax.engine.detokenizer import load_tokenizer
from hisparse_jax.engine.sampling import sample
from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
from hisparse_jax.serving.client import generate
from hisparse_jax.serving.server import serve
from tests.tiny_model import TINY_HISPARSE, all_kv_free, tiny_model_dir, tiny_model_with_tokenizer

SMALL = dict(page_size=16, chunked_prefill_size=64)


def test_sampling_rows_are_independent_and_filters_hold():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal((4, 50)) * 3, jnp.float32)
  greedy = np.asarray(jnp.argmax(logits, -1))
  t = jnp.array([0.0, 1.0, 1.0, 1.0])
  k = jnp.array([0, 1, 0, 3])
  p = jnp.array([1.0, 1.0, 1.0, 1.0])
  seeds = jnp.array([1, 2, 3, 4], jnp.uint32)
  pos = jnp.array([5, 5, 5, 5])
  out = np.asarray(sample(logits, t, k, p, seeds, pos))
  assert out[0] == greedy[0] and out[1] == greedy[1]  # greedy row; top_k=1 is greedy too
  top3 = set(np.argsort(-np.asarray(logits[3]))[:3])
  draws = [int(sample(logits, t, k, p, seeds, jnp.array([5, 5, 5, n]))[3]) for n in range(60)]
  assert set(draws) <= top3 and len(set(draws)) > 1
  # top_p: a tiny mass keeps only the most likely token.
  out = np.asarray(sample(logits, jnp.ones(4), jnp.zeros(4, jnp.int32), jnp.full(4, 1e-6), seeds, pos))
  np.testing.assert_array_equal(out, greedy)
  # A row's draw does not depend on the other rows.
  other = jnp.asarray(rng.standard_normal((4, 50)), jnp.float32).at[2].set(logits[2])
  a = sample(logits, t, k, p, seeds, pos)[2]
  b = sample(other, jnp.array([1.0, 0.0, 1.0, 0.5]), jnp.array([5, 0, 0, 2]), p, seeds, pos)[2]
  assert int(a) == int(b)


@pytest.fixture(scope="module")
def tokenized_model(tmp_path_factory):
  return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tok") / "m")


def run(engine, reqs):
  for r in reqs:
    engine.submit(r)
  engine.run()
  return reqs


def test_engine_sampling_seeds_and_stops(tokenized_model):
  eng = Engine(
    tokenized_model,
    hisparse=HiSparseConfig(**TINY_HISPARSE),
    max_running_requests=3,
    max_seq_len=128,
    tokenizer=load_tokenizer(tokenized_model),
    deterministic=True,
    **SMALL,
  )
  prompt = list(range(2, 30))
  a, b, c, g = run(
    eng,
    [
      Request("a", prompt, 12, temperature=1.0, seed=7),
      Request("b", prompt, 12, temperature=1.0, seed=7),
      Request("c", prompt, 12, temperature=1.0, seed=8),
      Request("g", prompt, 12),
    ],
  )
  assert a.output_ids == b.output_ids != c.output_ids
  # The same seeded request alone (different neighbours) gives the same tokens.
  assert run(eng, [Request("a2", prompt, 12, temperature=1.0, seed=7)])[0].output_ids == a.output_ids
  # Stop token: the greedy output's third token.
  st = run(eng, [Request("s", prompt, 12, stop_token_ids=(g.output_ids[2],))])[0]
  assert st.finish_reason == "stop_token" and st.output_ids == g.output_ids[: g.output_ids.index(g.output_ids[2]) + 1]
  # Stop string: text of the greedy output's first two tokens.
  text = eng.tokenizer.decode(g.output_ids[:2], skip_special_tokens=True)
  assert text
  ss = run(eng, [Request("t", prompt, 12, stop=(text[-1],))])[0]
  assert ss.finish_reason == "stop_string" and ss.matched_stop == text[-1] and len(ss.output_ids) <= 2
  # One str is one stop string (vLLM, OpenAI), not its characters; one int is one stop token.
  whole = text[-1] + "\u2603" * 3
  one = run(
    eng,
    [
      Request("t1", prompt, 12, stop=whole),
      Request("t2", prompt, 12, stop_token_ids=g.output_ids[2]),
      Request("t3", prompt, 12, stop_token_ids=np.int64(g.output_ids[2])),
    ],
  )
  assert one[0].stop == (whole,) and one[0].output_ids == g.output_ids and one[0].finish_reason == "length"
  assert one[1].finish_reason == one[2].finish_reason == "stop_token"
  assert one[1].output_ids == one[2].output_ids == st.output_ids
  # The returned text ends before the stop string (OpenAI / vLLM / SGLang), unless asked to keep it.
  assert ss.text == text[: text.index(text[-1])] and text[-1] not in ss.text
  kept = run(eng, [Request("u", prompt, 12, stop=(text[-1],), include_stop_str_in_output=True)])[0]
  assert kept.text == text[: text.index(text[-1]) + 1]
  # A token that completes a stop string and is a stop token too: the reason matches the cut text.
  cut = ss.output_ids[-1]
  both = run(eng, [Request("v", prompt, 12, stop=(text[-1],), stop_token_ids=(cut,))])[0]
  assert both.output_ids == ss.output_ids and both.text == ss.text
  assert both.finish_reason == "stop_string" and both.matched_stop == text[-1]

  # A request that ends inside a character: the flushed U+FFFD is streamed too, and a stop it completes is one.
  def held(i):  # a token that starts a multi-byte character: nothing to show until the end of the text
    detok = eng._detokenizers()
    return detok.push(i) == "" and detok.flush() == "\ufffd"

  lead = next(i for i in range(eng.config.vocab_size) if held(i))
  exported = run(eng, [Request("e", prompt, 1, export_kv=True)])[0]
  for stop, reason in (((), "length"), (("\ufffd",), "stop_string")):
    deltas = []
    r = run(
      eng,
      [
        Request(
          "f",
          prompt,
          1,
          prompt_kv=exported.prompt_kv,
          first_token=lead,
          stop=stop,
          on_token=lambda _, d: deltas.append(d),
        )
      ],
    )[0]
    assert r.output_ids == [lead] and r.finish_reason == reason
    assert "".join(deltas) == r.text == ("\ufffd" if reason == "length" else "")
  for bad, msg in [
    (dict(stop=("",)), "non-empty"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop_token_ids=(10**6,)), "stop token"),
    (dict(stop=None), "stop must be a list, got NoneType"),
    (dict(stop_token_ids=2.5), "stop_token_ids must be a list, got float"),
  ]:
    with pytest.raises(RequestError, match=msg):
      eng.submit(Request("x", prompt, 4, **bad))


def test_admission_by_free_pages_and_queue_bound():
  """The device KV budget is a number of pages; a request is admitted while its prompt's pages are free
  and holds pages only for the tokens it has."""
  d = tiny_model_dir()
  probe = Engine(d, max_running_requests=4, max_seq_len=256, deterministic=True, **SMALL)
  per_page = probe.memory_plan.pools["kv"][2]
  assert per_page == 16 * 3 * (48 * 4 + 16 * 4)  # page x layers x (latent row + indexer key) bytes
  eng = Engine(
    d,
    max_running_requests=4,
    max_seq_len=256,
    max_device_kv_bytes=8 * per_page + 5,
    max_queued_requests=3,
    deterministic=True,
    **SMALL,
  )
  assert eng.memory_plan.pools["kv"][1] == 8
  # 45-token prompts: 3 pages each at admission (prompt + first token), 4 by the end (55 tokens).
  reqs = [Request(str(i), list(range(2, 47)), 10) for i in range(3)]
  for r in reqs:
    eng.submit(r)
  eng.step()
  loads = eng.loads()
  assert loads["running"] == 2 and loads["queued"] == 1  # two prompts' pages fit, the third waits
  assert loads["device_kv_bytes_used"] == 6 * per_page and loads["device_kv_bytes_budget"] == 8 * per_page
  # The queue bound (3) counts waiting requests beyond the 2 free request slots: 1 + 4 more wait, a 6th fails.
  for i in range(4):
    eng.submit(Request(f"q{i}", [5, 6], 2))
  with pytest.raises(RequestError, match="queue full") as e:
    eng.submit(Request("q4", [5, 6], 2))
  assert e.value.code == "RESOURCE_EXHAUSTED" and len(eng.waiting) == 5
  with pytest.raises(RequestError, match="needs 10 pages of the kv pool") as e:
    eng.submit(Request("big", list(range(2, 152)), 10))  # 160 tokens: 10 pages, the pool holds 8
  assert e.value.code == "RESOURCE_EXHAUSTED"
  eng.run()
  assert all(r.finish_reason == "length" for r in reqs) and all_kv_free(eng.loads())
  assert eng.num_preemptions == 0
  # A burst of max_running_requests + max_queued_requests (4 + 3) on the idle engine is accepted whole.
  burst = [Request(f"b{i}", [5, 6, 7], 2) for i in range(7)]
  for r in burst:
    eng.submit(r)
  with pytest.raises(RequestError, match="queue full"):
    eng.submit(Request("b7", [5, 6, 7], 2))
  eng.run()
  assert all(r.finish_reason == "length" for r in burst) and all_kv_free(eng.loads())
  # Same tokens as without a budget.
  assert [r.output_ids for r in run(probe, [Request(str(i), list(range(2, 47)), 10) for i in range(3)])] == [
    r.output_ids for r in reqs
  ]


@pytest.fixture(scope="module")
def server(tokenized_model):
  big_pool = dict(TINY_HISPARSE, host_to_device_ratio=16)  # room for one 240-token request
  engine = Engine(
    tokenized_model,
    hisparse=HiSparseConfig(**big_pool),
    max_running_requests=2,
    max_seq_len=256,
    tokenizer=load_tokenizer(tokenized_model),
    **SMALL,
  )
  srv, loop, port = serve(engine, load_tokenizer(tokenized_model), "127.0.0.1", 0)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  yield engine, hisparse_pb2_grpc.HiSparseInferenceStub(channel)
  channel.close()
  srv.stop(0).wait()
  loop.stop()


def test_an_abort_while_the_prompt_is_tokenized_is_kept(server, monkeypatch):
  """An Abort that arrives while the request's text is still being tokenized (0.75 s for 1 MB; here held on a
  gate) counts the request and ends it as ABORT before it reaches the engine (it was lost: the request then ran
  to its end)."""
  from hisparse_jax.serving.server import InferenceServicer

  engine, stub = server
  gate, tokenizing = threading.Event(), threading.Event()
  prompt_ids = InferenceServicer._prompt_ids

  async def held(self, request):
    tokenizing.set()
    while not gate.is_set():
      await asyncio.sleep(0.01)
    return await prompt_ids(self, request)

  monkeypatch.setattr(InferenceServicer, "_prompt_ids", held)
  for max_new in (200, 10**6):  # (the second is over the context: aborted first, it ends as ABORT all the same)
    gate.clear()
    tokenizing.clear()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      stream = pool.submit(
        lambda: list(
          generate(
            stub,
            text="e e e e " * 10,
            max_new_tokens=max_new,  # (ids < 512)
            request_id="early",
            timeout=60,
          )
        )
      )
      assert tokenizing.wait(30)
      assert stub.Abort(hisparse_pb2.AbortRequest(request_id="early"), timeout=10).aborted == 1
      gate.set()
      msgs = stream.result()
    assert len(msgs) == 1 and msgs[0].request_id == "early" and msgs[0].finished
    assert msgs[0].finish_reason == hisparse_pb2.ABORT and msgs[0].completion_tokens == 0
    assert msgs[0].prompt_tokens > 0
  loads = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
  assert loads.running == 0 and loads.queued == 0
  assert stub.Abort(hisparse_pb2.AbortRequest(request_id="early"), timeout=10).aborted == 0  # (forgotten)


def test_abort_rpc_getloads_and_stop_over_grpc(server):
  engine, stub = server
  base = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
  assert base.running == 0 and base.free_lanes == 2 and base.host_rows_total > 0
  assert base.free_host_rows == base.host_rows_total
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    long = pool.submit(
      lambda: list(generate(stub, input_ids=list(range(2, 40)), max_new_tokens=200, request_id="victim", timeout=60))
    )
    deadline = time.time() + 30
    while stub.GetLoads(hisparse_pb2.GetLoadsRequest()).running == 0 and time.time() < deadline:
      time.sleep(0.02)
    assert stub.Abort(hisparse_pb2.AbortRequest(request_id="victim"), timeout=10).aborted == 1
    msgs = long.result()
  final = msgs[-1]
  assert final.finished and final.finish_reason == hisparse_pb2.ABORT and final.completion_tokens < 200
  assert stub.Abort(hisparse_pb2.AbortRequest(request_id="nobody")).aborted == 0
  msgs = list(
    generate(stub, input_ids=list(range(2, 40)), max_new_tokens=20, temperature=0.8, seed=3, stop_token_ids=[])
  )
  again = list(generate(stub, input_ids=list(range(2, 40)), max_new_tokens=20, temperature=0.8, seed=3))
  assert [t for m in msgs for t in m.token_ids] == [t for m in again for t in m.token_ids]
  with pytest.raises(grpc.RpcError) as e:
    list(generate(stub, input_ids=[3, 4], max_new_tokens=3, stop=[""]))
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  loads = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
  assert loads.running == 0 and loads.free_host_rows == base.free_host_rows and loads.free_lanes == 2


def test_abort_right_after_admission_restores_baseline():
  eng = Engine(
    tiny_model_dir(),
    hisparse=HiSparseConfig(**TINY_HISPARSE),
    max_running_requests=2,
    max_seq_len=128,
    deterministic=True,
    **SMALL,
  )
  base = eng.loads()
  keep, victim = Request("keep", list(range(2, 30)), 8), Request("victim", list(range(3, 40)), 8)
  eng.submit(keep)
  eng.submit(victim)
  eng.step()  # both admitted; keep prefilled and decoding, victim waiting for the next chunk budget
  assert eng.loads()["running"] == 2 and len(keep.output_ids) == 2 and not victim.output_ids
  assert eng.abort("victim") is victim and victim.finish_reason == "abort"
  eng.run()
  alone = Request("alone", list(range(2, 30)), 8)
  eng.submit(alone)
  eng.run()
  assert keep.output_ids == alone.output_ids
  assert eng.loads() == base


def test_ignore_eos_generates_past_eos_and_engine_timings():
  engine = Engine(tiny_model_dir(), max_running_requests=2)
  first = Request("a", list(range(3, 20)), 6)
  engine.submit(first)
  engine.run()
  assert len(first.output_ids) == 6 and first.finish_reason == "length"
  # Make the model's 2nd generated token an EOS id: the same prompt now stops there, unless ignore_eos.
  engine.eos_ids = frozenset({first.output_ids[1]})
  stopped = Request("b", list(range(3, 20)), 6)
  kept = Request("c", list(range(3, 20)), 6, ignore_eos=True)
  engine.submit(stopped)
  engine.submit(kept)
  engine.run()
  assert stopped.finish_reason == "stop" and stopped.output_ids == first.output_ids[:2]
  assert kept.finish_reason == "length" and kept.output_ids == first.output_ids
  # The engine's time split counts every decode step it ran (5 + 5, with requests b and c sharing them).
  assert engine.decode_steps == 5 + 5 and engine.decode_seconds > 0 and engine.prefill_seconds > 0
