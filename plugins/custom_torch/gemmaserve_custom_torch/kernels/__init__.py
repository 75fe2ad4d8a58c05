"""Custom kernels of the custom_torch plugin.

``paged_decode_attention_reference`` (plain torch) is always importable; the Triton kernels are
exported only when ``triton`` imports (``HAS_TRITON``).
"""

from .reference import paged_decode_attention_reference

__all__ = ["HAS_TRITON", "paged_decode_attention_reference"]

try:
    from .paged_attention import paged_decode_attention
except ImportError:  # no triton on this platform
    HAS_TRITON = False
else:
    HAS_TRITON = True
    __all__.append("paged_decode_attention")
