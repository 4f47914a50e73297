"""Argument checks shared by the Triton launchers: a wrong call fails here with a clear message
instead of reading out of bounds on the device."""

import torch


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    unit_last_stride: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {dtypes}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if unit_last_stride and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
