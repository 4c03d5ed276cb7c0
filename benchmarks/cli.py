"""Command-line pieces shared by the benchmark scripts: argparse types, the results path and writer."""

from __future__ import annotations

import argparse
import json
import os


def positive_ints(text: str) -> list[int]:
  """argparse type: "2048,4096" -> [2048, 4096] (distinct positive integers, sorted)."""
  try:
    values = sorted({int(x) for x in text.split(",")})
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or values[0] <= 0:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def positive_ints_at_most(high: int):
  """argparse type: as ``positive_ints``, each at most ``high``."""

  def parse(text: str) -> list[int]:
    values = positive_ints(text)
    if values[-1] > high:
      raise argparse.ArgumentTypeError(f"{values[-1]} is more than {high}")
    return values

  return parse


def sections(choices):
  """argparse type: a comma-separated, non-empty subset of choices, in the order given."""

  def parse(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in choices]
    if bad or not names:
      raise argparse.ArgumentTypeError(f"unknown section(s) {bad or [text]}; choose from {','.join(choices)}")
    return names

  return parse


def _numbers_in(convert, noun: str, low, high):
  def parse(text: str) -> list:
    try:
      values = [convert(x) for x in text.split(",")]
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}") from None
    if bad := [v for v in values if not low <= v <= high]:  # NaN fails too
      raise argparse.ArgumentTypeError(f"{bad[0]} is outside [{low}, {high}]")
    return values

  return parse


def ints_in(low: int, high: int):
  """argparse type: comma-separated integers, each in [low, high] (as given, in order)."""
  return _numbers_in(int, "integers", low, high)


def floats_in(low: float, high: float):
  """argparse type: comma-separated numbers, each in [low, high] (NaN refused)."""
  return _numbers_in(float, "numbers", low, high)


def int_in(low: int, high: int):
  """argparse type: one integer in [low, high]."""
  many = ints_in(low, high)

  def parse(text: str) -> int:
    if "," in text:
      raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
    return many(text)[0]

  return parse


def out_path(text: str) -> str:
  """argparse type for a results path (a file name, or a name the script adds extensions to): a non-empty name
  whose folder exists or can be made, and can hold a new file; checked before any work, so that a run never
  computes for minutes and then fails to write."""
  import tempfile

  if not text or not os.path.basename(text) or os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r}: expected a file name, not a folder")
  folder = os.path.dirname(os.path.abspath(text))
  above = folder
  while not os.path.exists(above) and os.path.dirname(above) != above:
    above = os.path.dirname(above)
  if not os.path.isdir(above):  # (makedirs would say "File exists")
    raise argparse.ArgumentTypeError(f"{text!r}: {above} is a file, not a folder")
  try:
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
      pass
  except OSError as e:
    raise argparse.ArgumentTypeError(f"{text!r}: cannot write in {folder} ({e.strerror or e})") from None
  return text


def check_memory(ap: argparse.ArgumentParser, nbytes: int, what: str) -> None:
  """ap.error (exit 2) when the run would allocate ``nbytes`` bytes (``what`` names them and the flags that set
  them), more than 80% of this machine's physical memory: refused before allocating, not after minutes."""
  have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if nbytes > 0.8 * have:
    ap.error(f"{what} need {nbytes / 2**30:.1f} GiB, more than 80% of this machine's {have / 2**30:.1f} GiB")


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OUT_HELP = (
  "results path without extension (default: benchmarks/results/local/NAME, or with --quick "
  "benchmarks/results/quick/NAME, both git-ignored: only an explicit --out, as `make bench` passes, "
  "writes the committed results BENCHMARKS.md quotes)"
)


def default_out(name: str, quick: bool) -> str:
  """Where a benchmark writes when --out is not given: a git-ignored folder (``quick`` for --quick smoke runs,
  ``local`` otherwise), so an ad-hoc run never overwrites the committed results (``make bench`` names them)."""
  return os.path.join(RESULTS, "quick" if quick else "local", name)


def write_results(out: str, results: dict, markdown: str) -> None:
  """OUT.json (every number) and OUT.md (the tables and the run's duration), also printed."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(results, f, indent=1)
  text = markdown + f"\n({results['seconds']:.0f} s)\n"
  with open(out + ".md", "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  raise SystemExit(f"{__file__}: a module of the benchmarks, not a benchmark: run any benchmark script")
