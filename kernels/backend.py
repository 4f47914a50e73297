"""Which implementation each public kernel entry point dispatches to.

`auto` (the default) runs Triton on CUDA tensors when Triton is installed and the torch path
otherwise; `torch` or `triton` force one. Set by env BATCHWIRE_KERNELS or `set_backend`.
"""

from __future__ import annotations

import os

import torch
from batchwire.kernels._triton import HAS_TRITON

BACKENDS = ("auto", "torch", "triton")


def _from_env() -> str:
    value = os.environ.get("BATCHWIRE_KERNELS", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"BATCHWIRE_KERNELS={value!r}: expected one of {BACKENDS}")
    return value


_backend = _from_env()


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r}: expected one of {BACKENDS}")
    if name == "triton" and not HAS_TRITON:
        raise RuntimeError("kernel backend 'triton' was asked for but Triton is not installed")
    _backend = name


def get_backend() -> str:
    return _backend


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the call on `tensor` should go to the Triton launcher."""
    if _backend == "torch":
        return False
    if _backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("BATCHWIRE_KERNELS=triton but Triton is not installed")
        return True
    return HAS_TRITON and tensor.is_cuda
