"""The top-level Bazel BUILD really builds the CPU handler library, and JAX can run it."""

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from hisparse_jax.kernels import ops, reference
from hisparse_jax.kernels.reference import WORKED_EXAMPLE_PAGE_SIZE, host_rows_of, worked_example
from tests.test_swap_in_kernel import POOL, device_args

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bazel_library():
  if shutil.which("bazel") is None:
    reason = "bazel not found (Debian: apt-get install bazel-bootstrap)"
    if os.environ.get("CI"):
      pytest.fail(f"{reason}; .ci/run installs it")
    pytest.skip(reason)
  env = dict(os.environ, HISPARSE_PYTHON=sys.executable)
  # A short idle timeout: the Bazel server must not outlive the test run by hours.
  bazel = ["bazel", "--max_idle_secs=60"]
  r = subprocess.run(
    [*bazel, "build", "//:hisparse_ffi_cpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
  )
  assert r.returncode == 0, r.stderr[-3000:]
  out = subprocess.run(
    [*bazel, "info", "bazel-bin"], cwd=REPO, env=env, capture_output=True, text=True, check=True
  ).stdout.strip()
  return pathlib.Path(out) / "libhisparse_ffi_cpu.so"


def test_bazel_library_runs_the_worked_example(bazel_library):
  lib = ctypes.cdll.LoadLibrary(str(bazel_library))
  jax.ffi.register_ffi_target("hisparse_swap_in_bazel", jax.ffi.pycapsule(lib.HisparseSwapInCpu), platform="cpu")
  case = worked_example()
  call = jax.jit(lambda *a: ops.swap_in(*a, page_size=WORKED_EXAMPLE_PAGE_SIZE, target="hisparse_swap_in_bazel"))
  rows, _, hot, slot_tokens, lru, stats, status = (np.asarray(x) for x in call(*device_args(case)))
  assert status.tolist() == [0]
  np.testing.assert_array_equal(rows[0], [21, 24, 20, -1])
  np.testing.assert_array_equal(slot_tokens[0, 4], [8, 3, 7, 12])
  np.testing.assert_array_equal(lru[0, 4], [2, 3, 0, 1])
  host_row_of_8 = host_rows_of(case[4][0], WORKED_EXAMPLE_PAGE_SIZE)[8]
  np.testing.assert_array_equal(hot[0].reshape(-1, 3)[20], case[POOL][0, host_row_of_8])
  # Same error contract as the pip-built module: the row's status, nothing changed.
  case[1][0, 0] = 16
  out = [np.asarray(x) for x in call(*device_args(case))]
  assert out[6].tolist() == [reference.POSITION_OUT_OF_RANGE] and (out[0] == -1).all()
  np.testing.assert_array_equal(out[4], case[9])


def test_bazel_library_exports_the_argmax(bazel_library):
  lib = ctypes.cdll.LoadLibrary(str(bazel_library))
  jax.ffi.register_ffi_target("hisparse_argmax_bazel", jax.ffi.pycapsule(lib.HisparseArgmaxCpu), platform="cpu")
  x = np.float32([[1, 3, 3, -np.inf], [np.nan, 2, np.nan, 9], [-np.inf] * 4])
  call = jax.ffi.ffi_call("hisparse_argmax_bazel", jax.ShapeDtypeStruct((3,), np.int32))
  np.testing.assert_array_equal(np.asarray(jax.jit(call)(x)), [1, 0, 0])
  jax.ffi.register_ffi_target(
    "hisparse_argmax_columns_bazel", jax.ffi.pycapsule(lib.HisparseArgmaxColumnsCpu), platform="cpu"
  )
  columns = jax.ffi.ffi_call("hisparse_argmax_columns_bazel", jax.ShapeDtypeStruct((4,), np.int32))
  np.testing.assert_array_equal(np.asarray(jax.jit(columns)(x)), [1, 0, 1, 1])
