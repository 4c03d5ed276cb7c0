"""The docs and docstrings name only paths that exist: every repository path in a tracked text file (README,
BENCHMARKS, sources, comments) is a file or folder of the repository, a results stem with its files
(``benchmarks/results/NAME`` -> NAME.json / NAME.md), or a git-ignored output path."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = ("hisparse_jax", "models", "tests", "benchmarks", "scripts", "xla_ffi", "examples", "docs", ".ci")
PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*\w)" % "|".join(re.escape(t) for t in TOP))
DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b")  # README.md, BENCHMARKS.md, ...
TEXT = (".py", ".h", ".cc", ".cu", ".md", ".proto", ".toml", ".sh", "Makefile", "BUILD", "CMakeLists.txt")


def _tracked() -> list[str]:
  out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
  return [f for f in out.split() if f.endswith(TEXT)]


def _ignored(paths: list[str]) -> set[str]:
  r = subprocess.run(
    ["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(paths), capture_output=True, text=True
  )
  return set(r.stdout.split())


def _exists(name: str) -> bool:
  path = ROOT / name
  return path.exists() or any(path.parent.glob(path.name + ".*"))  # a results stem


def test_every_path_named_in_docs_and_code_exists():
  named: dict[str, set[str]] = {}
  for f in _tracked():
    if f == "tests/test_docs.py":
      continue
    text = (ROOT / f).read_text(errors="replace")
    for m in PATH.finditer(text):
      named.setdefault(m.group(1).rstrip("."), set()).add(f)
    for m in DOC.finditer(text):
      if not m.group(1).startswith("OUT."):  # --out OUT writes OUT.json and OUT.md
        named.setdefault(m.group(1), set()).add(f)
  missing = [p for p in named if not _exists(p)]
  ignored = _ignored(missing + [p + "/" for p in missing])  # (a folder pattern matches "name/" only)
  stale = {p: sorted(named[p]) for p in missing if p not in ignored and p + "/" not in ignored}
  assert len(named) > 100 and not stale, stale


def test_engine_flags_are_described_once_and_listed_by_help():
  """Each engine flag's text is its EngineArgs field's help: docs/batch-decoding.md's table is generated from
  them (scripts/update_flag_table.py), and both entry points' --help list every engine flag with that text."""
  import dataclasses
  import sys

  sys.path.insert(0, str(ROOT / "scripts"))
  import update_flag_table

  from hisparse_jax.engine.args import EngineArgs

  page = update_flag_table.PAGE.read_text()
  assert update_flag_table.updated(page) == page, "docs/batch-decoding.md: run scripts/update_flag_table.py"
  fields = dataclasses.fields(EngineArgs)
  assert all(f.metadata["help"] and "|" not in f.metadata["help"] for f in fields)
  for program in (["run_server.py"], ["-m", "hisparse_jax.generate"]):
    r = subprocess.run([sys.executable, *program, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (program, r.stderr[-2000:])  # (absl itself exits 1 after the help)
    text = " ".join((r.stdout + r.stderr).split())
    for f in fields:
      flag = ("[no]" if "bool" in f.type else "") + f.name.replace("_", "-")  # (absl: --[no]deterministic)
      assert f"--{flag}: " + " ".join(f.metadata["help"].split())[:40] in text, (program, flag)
