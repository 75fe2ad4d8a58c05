"""custom_torch's sampling: the shared torch implementation of the sampling definition
(:mod:`gemmaserve.torch_sampling`, also used by hf_torch) and `DeviceTokens`, the pending tokens of an
asynchronous step."""

from __future__ import annotations

import torch

from gemmaserve.backend import PendingTokens, SampledTokens  # noqa: F401 (SampledTokens: result type)
from gemmaserve.torch_sampling import pinned_mask_memory, sample_on_device, sample_tokens, sampled_from_host, to_device

__all__ = ["DeviceTokens", "pinned_mask_memory", "sample_tokens", "sample_on_device", "to_device"]


class DeviceTokens(PendingTokens):
    """Sampled tokens (and logprobs) still on the device: the copy to pinned host memory is queued at once,
    :meth:`result` waits for it alone (not for work queued after it). On CPU the copy is immediate."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> None:
        self._done: torch.cuda.Event | None = None
        self._sampled: SampledTokens | None = None
        if tokens.device.type != "cuda":
            self._host = (tokens.cpu(), None if logprobs is None else logprobs.cpu())
            return
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
            host_logprobs.copy_(logprobs, non_blocking=True)
        self._host = (host_tokens, host_logprobs)
        self._done = torch.cuda.Event()
        self._done.record()

    def result(self) -> SampledTokens:
        if self._sampled is None:
            if self._done is not None:
                self._done.synchronize()
            tokens, logprobs = self._host
            self._sampled = sampled_from_host(tokens.tolist(), logprobs)
        return self._sampled
