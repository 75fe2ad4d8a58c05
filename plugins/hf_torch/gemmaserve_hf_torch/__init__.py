"""gemmaserve backend plugin ``hf``: any Hugging Face causal LM through transformers + torch.

Importing this package is light (no torch); the backend lives in :mod:`gemmaserve_hf_torch.backend`
and is created through the registry's factory path ``gemmaserve_hf_torch.backend:create_backend``.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
