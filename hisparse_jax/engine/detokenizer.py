"""Tokenizer loading, prompt encoding and incremental (streaming) detokenization.

One ``IncrementalDetokenizer`` per request turns its output ids into text as they are produced, in
O(new bytes) per token (never a decode of the whole output), and serves both the streamed text and the
stop-string search (``StopStringMatcher``).

Byte-level BPE tokenizers (DeepSeek-V3, GLM: a ``ByteLevel`` decoder) are decoded exactly: each id maps
to its bytes once (a table built per tokenizer), and Python's incremental UTF-8 decoder with
``errors="replace"`` turns the byte stream into text. It holds back only a multi-byte sequence that is
still incomplete and could be completed by later bytes; invalid bytes (e.g. a lone continuation byte,
which a model can genuinely produce: id 225 of DeepSeek-V3 is byte 0xA1) come out at once as U+FFFD.
The concatenated text equals ``tokenizer.decode(ids, skip_special_tokens=True)`` (same replacement rule).
Other tokenizers use the sliding-window method of vLLM / text-generation-inference (decode a few ids, emit
once the text no longer ends in U+FFFD).
"""

from __future__ import annotations

import codecs
import json
import os

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


MAX_TOKENIZER_BYTES = 256 * 2**20  # DeepSeek-V3.2's tokenizer.json is ~8 MB


def load_tokenizer(model_dir: str) -> Tokenizer | None:
  """The model directory's tokenizer.json, or None when it has none. ValueError (naming it) when it is not a
  regular file of at most MAX_TOKENIZER_BYTES (a FIFO would block, a link to /dev/zero never end), or when the
  tokenizers library cannot read it (its error's first line)."""
  from models.from_torch import check_regular_file

  path = os.path.join(model_dir, "tokenizer.json")
  if not os.path.lexists(path):
    return None
  check_regular_file(path, MAX_TOKENIZER_BYTES)
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot parse
    raise ValueError(f"{path}: not a tokenizers JSON file ({(str(e) or type(e).__name__).splitlines()[0]})") from None


def max_token_bytes(tokenizer: Tokenizer) -> int:
  """The most UTF-8 bytes of text one token can stand for (int): the longest token of the vocabulary, added
  tokens included, each decoded alone (a partial UTF-8 token decodes to U+FFFD, 3 bytes, which can only
  overstate it), times 4 when the tokenizer has a normalizer (NFKC and the like can fold a 4-byte character
  into a 1-byte one). So a text of more than ``n * max_token_bytes`` bytes cannot fit in n tokens, for any
  tokenizer whose tokens each stand for their own text (byte-level BPE: DeepSeek-V3's longest is 128 bytes);
  a model that fuses a run of unknown characters into one UNK token has no such bound. ~0.1 s for
  DeepSeek-V3's 129,280 ids."""
  size = tokenizer.get_vocab_size(with_added_tokens=True)
  texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
  longest = max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1)
  normalizer = json.loads(tokenizer.to_str()).get("normalizer") or {}
  folds = normalizer.get("type") != "Sequence" or bool(normalizer.get("normalizers"))
  return max(longest, 1) * (4 if normalizer and folds else 1)


GIL_FREE_ENCODE_CHARS = 4096


def encode_prompt(tokenizer: Tokenizer, text: str, bos_token_id: int | None) -> list[int]:
  """Token ids of text with exactly one BOS first (as DeepSeek's chat template starts): the model's BOS id
  is prepended unless the text already begins with the BOS token's text (a chat-formatted prompt), which
  the tokenizer parses into that id. Empty text gives []. Texts over GIL_FREE_ENCODE_CHARS go through
  ``encode_batch``, which releases the GIL while it works (``encode`` holds it: tokenizing a 1 MB text on a
  server thread would stall the decode loop for ~0.5 s)."""
  if len(text) > GIL_FREE_ENCODE_CHARS:  # encode_batch_fast: no offsets (tokenizers >= 0.20), ~30% faster and smaller
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    ids = encode([text], add_special_tokens=False)[0].ids
  else:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
  if bos_token_id is None or not ids or ids[0] == bos_token_id:
    return ids
  return [bos_token_id] + ids


def _byte_level_table(tokenizer: Tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
  """id -> bytes for a byte-level BPE tokenizer (None for other decoders). Ids the tokenizer does not know
  decode to b"" (as tokenizer.decode skips them)."""
  spec = json.loads(tokenizer.to_str()).get("decoder") or {}
  if spec.get("type") != "ByteLevel":
    return None
  # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to code points 256 + n.
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
  byte_of = {chr(b): b for b in printable}
  n = 0
  for b in range(256):
    if b not in printable:
      byte_of[chr(256 + n)] = b
      n += 1

  def to_bytes(token: str) -> bytes:  # characters outside the byte alphabet pass through as UTF-8
    return b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode() for c in token)

  size = tokenizer.get_vocab_size(with_added_tokens=True)
  table = [b""] * size
  for token, i in tokenizer.get_vocab(with_added_tokens=False).items():
    if i < size:
      table[i] = to_bytes(token)
  for i, added in tokenizer.get_added_tokens_decoder().items():
    if i < size:
      table[i] = b"" if (added.special and skip_special_tokens) else to_bytes(added.content)
  return table


class DetokenizerFactory:
  """Builds per-request ``IncrementalDetokenizer``s for one tokenizer (the byte table is built once)."""

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
    self.tokenizer = tokenizer
    self.skip_special_tokens = skip_special_tokens
    self.table = _byte_level_table(tokenizer, skip_special_tokens)

  def __call__(self) -> "IncrementalDetokenizer":
    return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
  """Text deltas of a growing list of output ids. ``push(id)`` returns the text completed by that id ("" while
  a multi-byte character is incomplete); ``flush()`` whatever is left at the end (an incomplete trailing
  sequence as U+FFFD). The concatenated deltas equal ``tokenizer.decode(ids, skip_special_tokens=True)``."""

  # Ids kept before the read position in the fallback (context for tokenizers that merge across ids).
  _CONTEXT = 6

  def __init__(self, factory: DetokenizerFactory):
    self._factory = factory
    self._table = factory.table
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if self._table is not None else None
    self._ids: list[int] = []
    self._prefix = 0  # fallback: window start
    self._read = 0  # fallback: ids already turned into text

  def push(self, token_id: int) -> str:
    if self._utf8 is not None:
      raw = self._table[token_id] if 0 <= token_id < len(self._table) else b""
      return self._utf8.decode(raw)
    self._ids.append(token_id)
    return self._window(final=False)

  def flush(self) -> str:
    if self._utf8 is not None:
      return self._utf8.decode(b"", final=True)
    return self._window(final=True)

  def _window(self, final: bool) -> str:
    decode = self._factory.tokenizer.decode
    skip = self._factory.skip_special_tokens
    seen = decode(self._ids[self._prefix : self._read], skip_special_tokens=skip)
    text = decode(self._ids[self._prefix :], skip_special_tokens=skip)
    if len(text) <= len(seen) or (text.endswith(REPLACEMENT_CHAR) and not final):
      return ""
    self._read = len(self._ids)
    self._prefix = max(0, self._read - self._CONTEXT)
    # Re-anchor on the new window so the next delta is measured against the same context.
    delta = text[len(seen) :]
    return delta


class StopStringMatcher:
  """Finds the first stop string in a growing text, looking only at its new characters, and says how much
  text is safe to stream: everything except a tail that could still become a stop string.

  ``feed(delta)`` -> (text to release now, matched stop string or None). On a match the released text ends
  right before the stop string (or after it with include_stop), the OpenAI / vLLM / SGLang convention.
  The match is the stop that starts earliest among those the delta completes (on a tie, the first listed):
  a stop that contains another (["xabc", "b"]) can therefore match differently as the text is split.
  """

  def __init__(self, stops, include_stop: bool = False):
    self.stops = tuple(stops)
    self.include_stop = include_stop
    self._longest = max(map(len, self.stops), default=0)
    self.text = ""
    self.sent = 0  # characters of self.text released

  def feed(self, delta: str) -> tuple[str, str | None]:
    start = max(0, len(self.text) - self._longest + 1)
    self.text += delta
    if not self.stops:
      return self._release(len(self.text)), None
    best = None
    for s in self.stops:
      i = self.text.find(s, start)
      if i >= 0 and (best is None or i < best[0]):
        best = (i, s)
    if best is not None:
      i, s = best
      self.text = self.text[: i + len(s) if self.include_stop else i]
      return self._release(len(self.text)), s
    return self._release(len(self.text) - self._held_tail()), None

  def finish(self) -> str:
    """The rest of the text, at the end of the request."""
    return self._release(len(self.text))

  def _held_tail(self) -> int:
    """Length of the longest suffix of the text that is a proper prefix of a stop string."""
    t = self.text
    for k in range(min(self._longest - 1, len(t)), 0, -1):
      tail = t[-k:]
      if any(s.startswith(tail) for s in self.stops):
        return k
    return 0

  def _release(self, end: int) -> str:
    end = max(end, self.sent)
    out, self.sent = self.text[self.sent : end], end
    return out
