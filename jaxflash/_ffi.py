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
    "cuda": False, "cuda_archs": "", "cuda_head_dims": ""}


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


def cuda_head_dims() -> tuple[int, ...]:
  return tuple(int(d) for d in BUILD_INFO["cuda_head_dims"].split(";") if d)


def missing_reason() -> str:
  return _IMPORT_ERROR
