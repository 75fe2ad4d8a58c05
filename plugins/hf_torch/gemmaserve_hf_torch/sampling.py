"""hf_torch's sampling: the shared torch implementation of the sampling definition
(:mod:`gemmaserve.torch_sampling`), so a seed gives the same tokens here as on custom_torch and mlx."""

from __future__ import annotations

from gemmaserve.torch_sampling import pinned_mask_memory, sample_tokens

__all__ = ["pinned_mask_memory", "sample_tokens"]
