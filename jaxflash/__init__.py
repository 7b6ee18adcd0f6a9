"""jaxflash: fused flash-attention kernels for JAX through XLA FFI custom calls."""

from jaxflash.attention import attention, attention_varlen
from jaxflash.reference import attention_reference

__all__ = ["attention", "attention_varlen", "attention_reference"]
__version__ = "0.1.0"
