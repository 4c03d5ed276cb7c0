"""What the absl entry points share (run_server.py, hisparse_jax.generate, hisparse_jax.plan,
hisparse_jax.serving.client)."""

from __future__ import annotations

import sys

HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def run(main) -> None:
  """``absl.app.run(main)``, except that a run asked only for help exits 0: absl prints the help and exits 1,
  which a shell or a script reads as a failure."""
  from absl import app

  argv = sys.argv[1 : sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
  try:
    app.run(main)
  except SystemExit as e:
    if e.code == 1 and any(a in HELP_FLAGS for a in argv):
      raise SystemExit(0) from None
    raise
