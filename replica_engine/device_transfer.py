"""Moving a step's small tensors between the host and the device without stalling the host.

On a GPU a plain `torch.tensor(values, device=cuda)` or `.tolist()` waits for every kernel
queued before it: with async scheduling that is the step still running. So host values go over
from pinned memory with non-blocking copies, and device values come back the same way behind the
step's kernels, with one event the host waits on when it reads them. On a CPU both are plain."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[float | int | bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device`, copied without waiting for the device's queue."""
    return move_to(torch.tensor(values, dtype=dtype), device)


def move_to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, without waiting for the device's queue."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors' copies on the host, queued behind the work that computes them."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        on_gpu = [t for t in tensors if t.device.type == "cuda"]
        if not on_gpu:
            self._host = list(tensors)
            return
        self._host = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            if t.device.type == "cuda"
            else t
            for t in tensors
        ]
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> list[torch.Tensor]:
        """The host tensors, once the copies are done (the only wait)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
