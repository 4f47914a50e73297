"""RMS normalisation, optionally fused with the residual add that precedes it."""

import torch


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with `residual`: residual = x + residual and the result is
    (norm(residual) * weight, residual)."""
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

