"""Tokenizer loading and incremental (streaming) detokenization."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(model_dir: str) -> Tokenizer | None:
  """The model directory's tokenizer.json, or None when it has none."""
  path = os.path.join(model_dir, "tokenizer.json")
  return Tokenizer.from_file(path) if os.path.exists(path) else None


def encode_prompt(tokenizer: Tokenizer, text: str, bos_token_id: int | None) -> list[int]:
  """Token ids of text, with the model's BOS id first (as DeepSeek's chat template starts)."""
  ids = tokenizer.encode(text, add_special_tokens=False).ids
  return ([bos_token_id] if bos_token_id is not None and ids else []) + ids


class TextStream:
  """Turns a growing list of output ids into text deltas that never split a UTF-8 character.

  ``push(id)`` returns the new text since the last call; while the decoded
  text ends in an incomplete multi-byte character (decoded as U+FFFD) it
  returns "" and the character comes out whole once its last byte arrives.
  The concatenated deltas equal ``tokenizer.decode(all ids)``.
  """

  def __init__(self, tokenizer: Tokenizer):
    self._tokenizer = tokenizer
    self._ids: list[int] = []
    self._text = ""

  def push(self, token_id: int) -> str:
    self._ids.append(token_id)
    text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
    if text.endswith(REPLACEMENT_CHAR) or not text.startswith(self._text):
      return ""
    delta, self._text = text[len(self._text):], text
    return delta

  def flush(self) -> str:
    """Whatever is left at the end (a trailing incomplete character included)."""
    text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
    delta, self._text = text[len(self._text):] if text.startswith(self._text) else "", text
    return delta
