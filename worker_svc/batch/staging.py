"""Host buffers for a step's inputs, and the fence that keeps them from being overwritten while a
copy to the accelerator is still reading them.

On CUDA the buffers are pinned, so `.to(device, non_blocking=True)` is a real asynchronous copy;
the next step waits on an event recorded after this step's copies before it writes the buffers
again (the walkthrough's synchronize_input_prep). On CPU the inputs are used in place: plain
memory and no fence.
"""

from __future__ import annotations

import torch


def host_buffer(
    size: int | tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed host tensor of that size, pinned when the step's inputs go to a CUDA device."""
    return torch.zeros(size, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


class InputFence:
    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._recorded = False

    def wait(self) -> None:
        """Blocks until the copies of the last recorded step have read their host buffers."""
        if self._event is not None and self._recorded:
            self._event.synchronize()

    def record(self) -> None:
        """Marks the end of this step's host-to-device copies on the current stream."""
        if self._event is not None:
            self._event.record()
            self._recorded = True
