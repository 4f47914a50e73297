"""The one place Triton is imported, so every kernel module imports where Triton is absent.

Kernel modules write `from batchwire.kernels._triton import triton, tl` and decorate with
`@triton.jit`; without Triton the decorator returns the plain function, which is never launched.
"""

from __future__ import annotations

import types
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the torch paths serve every call.
    HAS_TRITON = False

    def _jit(fn: Any = None, **_: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    def _cdiv(a: int, b: int) -> int:
        return -(-a // b)

    def _next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()

    triton = types.SimpleNamespace(jit=_jit, cdiv=_cdiv, next_power_of_2=_next_power_of_2)
    # Only the annotations (`x: tl.constexpr`) are evaluated at import time.
    tl = types.SimpleNamespace(constexpr=Any)

__all__ = ["HAS_TRITON", "triton", "tl"]
