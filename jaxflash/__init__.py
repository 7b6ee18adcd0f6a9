"""jaxflash: fused flash-attention kernels for JAX through XLA FFI custom calls."""

from jaxflash.attention import attention, attention_varlen
from jaxflash.reference import attention_reference
from jaxflash.sharding import ring_attention, zigzag_permute, zigzag_unpermute

__all__ = ["attention", "attention_varlen", "attention_reference", "ring_attention",
           "zigzag_permute", "zigzag_unpermute"]
__version__ = "0.1.0"


def __getattr__(name):
  # jaxflash.flax needs flax, an optional dependency: import it on first access only
  if name == "flax":
    import importlib
    return importlib.import_module("jaxflash.flax")
  raise AttributeError(f"module 'jaxflash' has no attribute {name!r}")
