"""RMS normalisation, optionally fused with the residual add that precedes it."""

import torch
from batchwire.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from batchwire.kernels._triton import tl, triton
from batchwire.kernels.backend import use_triton


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with `residual`: residual = x + residual and the result is
    (norm(residual) * weight, residual)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        # The sum is rounded to x.dtype before the norm reads it, as the unfused model does.
        residual = x + residual
        x = residual
    xf = x.float()
    variance = xf.square().mean(dim=-1, keepdim=True)  # [num_tokens, 1]
    out = (xf * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,  # read when HAS_RESIDUAL
    residual_out_ptr,  # written when HAS_RESIDUAL
    weight_ptr,
    hidden,
    eps,
    stride_out,
    stride_x,
    stride_res,
    stride_res_out,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # rounded like the reference
        tl.store(residual_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * tl.rsqrt(variance + eps) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor of at least 1 dim, got {x!r:.60}")
    # Any leading dims (e.g. per-head q/k norms on [num_tokens, heads, head_dim]) are rows.
    shape, hidden = x.shape, x.shape[-1]
    x = x.reshape(-1, hidden)
    check_tensor("x", x, 2, FLOAT_DTYPES)
    num_tokens = x.shape[0]
    check_tensor("weight", weight, 1, FLOAT_DTYPES, x.device)
    check_shape("weight", weight, (hidden,))
    out = torch.empty_like(x)
    residual_out = out  # unused placeholder pointer when there is no residual
    if residual is not None:
        check_shape("residual", residual, tuple(shape))
        residual = residual.reshape(-1, hidden)
        check_tensor("residual", residual, 2, (x.dtype,), x.device)
        residual_out = torch.empty_like(x)
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            out,
            x,
            residual if residual is not None else x,
            residual_out,
            weight,
            hidden,
            eps,
            out.stride(0),
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            residual_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), residual_out.view(shape)
