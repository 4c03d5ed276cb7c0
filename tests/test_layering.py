"""The package layering: ``models/`` is a leaf (the model runs without the runtime or its C++ extension)."""

import subprocess
import sys

from tests.test_mesh import ROOT

LEAF_CHECK = """
import pkgutil, sys
import jax.numpy as jnp
import models
for m in pkgutil.iter_modules(models.__path__):
  __import__(f"models.{m.name}")
from models.random_checkpoint import write_random_checkpoint
from models.loader import load_hf
from models.deepseek_v32 import prefill_prompts
from tests.tiny_model import scratch_dir, tiny_config
cfg, model = load_hf(write_random_checkpoint(scratch_dir("leaf-") + "/m", tiny_config(), seed=1))
logits, _ = prefill_prompts(model, jnp.arange(1, 11)[None], [10])
assert logits.shape == (1, 10, cfg.vocab_size), logits.shape
print(sorted(name for name in sys.modules if name.split(".")[0] == "hisparse_jax"))
"""


def test_models_is_a_leaf_package():
  """Every module of models/ imports, and a model loads and prefills, without importing hisparse_jax (whose
  kernels load the runtime's C++ extension): the runtime hands the model its top-k kernel and mesh layout."""
  r = subprocess.run([sys.executable, "-c", LEAF_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
