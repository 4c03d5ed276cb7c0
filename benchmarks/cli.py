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


def sections(choices):
  """argparse type: a comma-separated, non-empty subset of choices, in the order given."""

  def parse(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in choices]
    if bad or not names:
      raise argparse.ArgumentTypeError(f"unknown section(s) {bad or [text]}; choose from {','.join(choices)}")
    return names

  return parse


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OUT_HELP = ("results path without extension (default: benchmarks/results/NAME, the committed results BENCHMARKS.md "
            "quotes; with --quick benchmarks/results/quick/NAME, which git ignores)")


def default_out(name: str, quick: bool) -> str:
  """Where a benchmark writes when --out is not given: a --quick (smoke) run never overwrites the committed
  full results."""
  return os.path.join(RESULTS, "quick", name) if quick else os.path.join(RESULTS, name)


def write_results(out: str, results: dict, markdown: str) -> None:
  """OUT.json (every number) and OUT.md (the tables and the run's duration), also printed."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(results, f, indent=1)
  text = markdown + f"\n({results['seconds']:.0f} s)\n"
  with open(out + ".md", "w") as f:
    f.write(text)
  print(text)
