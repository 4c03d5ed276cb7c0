"""The CUDA swap-in/backup handlers are really compiled for sm_90a wherever nvcc exists."""

import pathlib
import shutil
import subprocess

import pytest

from hisparse_jax.kernels import ops


def _section(path: pathlib.Path, name: str) -> bytes:
  """Raw bytes of an ELF section, located with binutils' readelf."""
  out = subprocess.run(["readelf", "-W", "-S", str(path)], check=True, capture_output=True, text=True).stdout
  for line in out.splitlines():
    fields = line.replace("[ ", "[").split()
    if name in fields:
      i = fields.index(name)
      offset, size = int(fields[i + 3], 16), int(fields[i + 4], 16)
      return path.read_bytes()[offset : offset + size]
  raise AssertionError(f"no {name} section in {path}")


def test_cuda_handler_built_for_sm90a():
  if shutil.which("nvcc") is None:
    pytest.skip("nvcc not found on PATH: the build compiled the CPU handlers only")
  assert ops.cuda_handler_built(), "nvcc is on PATH but hisparse_jax._ffi_cuda was not built"
  from hisparse_jax import _ffi_cuda

  assert _ffi_cuda.cuda_arch == "sm_90a"
  assert set(_ffi_cuda.registrations()) == {
    ops.SWAP_IN_TARGET,
    ops.BACKUP_TARGET,
    ops.SWAP_IN_EXT_TARGET,
    ops.BACKUP_EXT_TARGET,
    ops.PREFETCH_START_TARGET,
    ops.PREFETCH_START_EXT_TARGET,
    ops.PREFETCH_WAIT_TARGET,
  }
  # The CPU module registers the same targets (plus its top-k and argmax: other platforms use XLA's own).
  assert set(ops._ffi_cpu.registrations()) == set(_ffi_cuda.registrations()) | {
    ops.TOP_K_TARGET,
    ops.ARGMAX_TARGET,
    ops.ARGMAX_COLUMNS_TARGET,
  }
  fatbin = _section(pathlib.Path(_ffi_cuda.__file__), ".nv_fatbin")
  assert len(fatbin) > 1000 and b"sm_90a" in fatbin
