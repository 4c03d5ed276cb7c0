"""Test-suite set-up.

Ordering: the longest modules first, so that under ``pytest -n 2 --dist loadfile`` (the Makefile's
``make test``) no worker is left alone with a long module at the end.

Compilation: one JAX persistent compilation cache for the whole run, shared by every subprocess the tests
start (CLI runs, benchmark scripts, servers, the mesh and multi-process checks; the variables are inherited),
which would otherwise compile the same programs on the same tiny models again. It lives in a fresh directory
per run (removed at the end), so nothing compiled by another checkout or jaxlib is ever loaded; a run that
sets JAX_COMPILATION_CACHE_DIR itself keeps its own.

The pytest processes themselves (the xdist workers, or the one process of a run without xdist) do not use
it: twice in full runs on 2026-12-02 a worker died of a segmentation fault inside jaxlib while writing a
cache entry (``compilation_cache.put_executable_and_time``, once during an in-process gRPC server test whose
engine thread was compiling), and under ``--dist loadfile`` xdist then hung until CI's time limit. Those
processes live for the whole run, hold hundreds of executables and run engine threads next to the test's
own; the short-lived subprocesses never crashed this way. With the cache on in the workers (full runs on
2026-12-03 and 2026-12-04, no crash) it saved 81 s of test_scheduling.py, 60 s of test_overlap.py and 46 s
of test_lossless.py (one worker's time each; the other modules together under 20 s: most of their programs
compile in under 0.1 s and are not stored), about 5% of the suite's wall time and less than run-to-run noise
(1,686 and 2,098 s for the suite with the cache, 1,877 s without), so the crash risk is not worth taking.

XLA:CPU optimization: the suite compiles at backend optimization level 0 (``tests/xla_env.py``'s
``SUITE_FLAG``, added to XLA_FLAGS here unless the caller sets a level; subprocesses inherit it). Compiling
dominates the suite (38 of the 50 s of the largest lossless test are XLA compiles) and level 0 compiles 25-30%
faster: test_lossless.py::test_every_eviction_policy_gives_the_dense_tokens 31 s against 42 s alone; in a full
2-worker run on 2026-12-05, 1,452 s for the suite against 1,752 s the day before (2,878 against 3,450 s of the
workers' test time), the mesh subprocess 265 s against 325 s; 1,362 s in the fresh-clone CI run that landed
it. Its code rounds some float32 results differently from the default level 3 (a tiny model's decode logits by
up to 3e-6 at magnitudes up to 3.5, the same greedy tokens; level 1 keeps them but saves only 10%), which no
test depends on: every comparison is between two runs at the same level, and
test_lossless.py::test_lossless_at_xla_default_optimization checks dense against HiSparse bit for bit at the
default level users run. Benchmark scripts that run real-size programs restore the default
(``xla_env.optimized``): at level 0 the throughput benchmark's quick run took 119 s against 83 s.

Memory mappings: JAX's compilation caches keep every executable a module compiled, and each XLA:CPU
executable holds about 10-70 memory mappings of its own. A worker that ran tests/test_glm.py held 10,319
entries in /proc/self/maps (1,003 programs); with engines' programs shared across modules (tried 2026-12-03)
one process reached 30,885 after tests/test_scheduling.py and a worker later died of a segmentation fault
inside ``backend_compile_and_load``, consistent with reaching the kernel's ``vm.max_map_count`` (65,530).
So after each module JAX's caches are cleared (``jax.clear_caches()``; test_glm's 10,319 entries fall to
617), which costs the next module only the recompilation of programs it shares with the one before.
"""

import gc
import os
import shutil
import tempfile

_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ
if _OWN_CACHE:  # the controller (or a run without xdist), before any worker or JAX starts
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="hisparse-jax-test-jit-cache-")
  # Programs that compile in under 0.1 s are not worth a file.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

from tests.xla_env import SUITE_FLAG  # noqa: E402

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # workers and subprocesses inherit it
  os.environ["XLA_FLAGS"] = f"{SUITE_FLAG} {os.environ.get('XLA_FLAGS', '')}".strip()

import jax  # noqa: E402  (after the variables above, which subprocesses inherit)
import pytest  # noqa: E402

# This process compiles without the persistent cache (see above); the environment keeps it for subprocesses.
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each module (its own fixtures are torn down first), drop JAX's compiled programs (see above)."""
  yield
  jax.clear_caches()
  gc.collect()


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# Slowest first (seconds of one worker in a 2-worker `make test`, 2026-12-02): the mesh subprocess ~800,
# benchmark scripts ~570, throughput benchmarks ~450, scheduling ~390, lossless ~300, multiprocess ~290; then
# collection order. The Makefile passes --no-loadscope-reorder, without which xdist orders modules by their
# number of tests instead.
FIRST = (
  "test_mesh.py",
  "test_benchmark_scripts.py",
  "test_throughput_benchmark.py",
  "test_scheduling.py",
  "test_lossless.py",
  "test_multiprocess.py",
  "test_fp8_checkpoint.py",
  "test_model_oracle.py",
  "test_cli.py",
  "test_disaggregation.py",
)


def pytest_collection_modifyitems(session, config, items):
  def rank(item):
    name = item.path.name
    return FIRST.index(name) if name in FIRST else len(FIRST)

  items.sort(key=rank)  # stable: the order inside a module is kept
