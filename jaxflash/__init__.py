"""jaxflash: fused flash-attention kernels for JAX through XLA FFI custom calls."""

from jaxflash.attention import attention, attention_varlen
from jaxflash.reference import attention_reference
from jaxflash.sharding import ring_attention, zigzag_permute, zigzag_unpermute

__all__ = ["attention", "attention_varlen", "attention_reference", "ring_attention",
           "zigzag_permute", "zigzag_unpermute"]
__version__ = "0.1.0"
