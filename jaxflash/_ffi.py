"""The only module that loads the compiled extension and registers its FFI targets."""

from __future__ import annotations

import jax

try:
  from jaxflash import _jaxflash_ext as _ext
except ImportError as e:  # an install without the compiled part
  _ext = None
  _IMPORT_ERROR = str(e)
else:
  _IMPORT_ERROR = ""

BUILD_INFO: dict = _ext.build_info() if _ext is not None else {
    "cuda": False, "cuda_archs": "", "cuda_head_dims": "", "cuda_bwd_head_dims": "",
    "cuda_dtypes": ""}


def _register() -> None:
  if _ext is None:
    return
  for platform, targets in _ext.registrations().items():
    for name, capsule in targets.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register()


def cpu_built() -> bool:
  return _ext is not None


def cuda_built() -> bool:
  return bool(BUILD_INFO["cuda"])


def _dims(key) -> tuple[int, ...]:
  return tuple(int(d) for d in BUILD_INFO.get(key, "").split(";") if d)


def cuda_head_dims() -> tuple[int, ...]:
  """Head dims the CUDA forward runs (for H, and for any Hv <= H)."""
  return _dims("cuda_head_dims")


def cuda_bwd_head_dims() -> tuple[int, ...]:
  """Head dims H the CUDA backward runs with Hv == H (and 192 with Hv == 128, the MLA pair):
  those with bwd_hdim<d> instantiations."""
  return _dims("cuda_bwd_head_dims")


def cuda_dtypes() -> tuple[str, ...]:
  """Input dtypes (numpy names) the CUDA kernels were built for (JAXFLASH_DTYPES)."""
  names = {"fp16": "float16", "bf16": "bfloat16"}
  # (an extension built before the option has both)
  return tuple(names[d] for d in BUILD_INFO.get("cuda_dtypes", "fp16;bf16").split(";") if d)


def missing_reason() -> str:
  return _IMPORT_ERROR
