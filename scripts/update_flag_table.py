"""Rewrites the engine-flag table of docs/batch-decoding.md from ``EngineArgs`` (the fields' help texts), the
one source of each flag's description. ``--check``: exit 1, changing nothing, if the page is out of date."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from hisparse_jax.engine.args import EngineArgs  # noqa: E402

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "batch-decoding.md"
FLAG_TABLE_BEGIN = "<!-- engine flags: generated from EngineArgs by scripts/update_flag_table.py -->"
FLAG_TABLE_END = "<!-- end of engine flags -->"


def updated(text: str) -> str:
  """The page's text with the table between the markers regenerated; ValueError without the markers."""
  start, end = text.find(FLAG_TABLE_BEGIN), text.find(FLAG_TABLE_END)
  if start < 0 or end < start:
    raise ValueError(f"{PAGE}: no {FLAG_TABLE_BEGIN!r} ... {FLAG_TABLE_END!r} block")
  return text[: start + len(FLAG_TABLE_BEGIN)] + "\n" + EngineArgs.flag_table() + "\n" + text[end:]


def main(argv: list[str]) -> int:
  text = PAGE.read_text()
  new = updated(text)
  if "--check" in argv:
    return int(new != text)
  PAGE.write_text(new)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
