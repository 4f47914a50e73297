"""Apply a packed grammar bitmask to logits: disallowed tokens get -inf."""

import torch


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    bitmask: torch.Tensor,  # [k, ceil(vocab / 32)] int32; bit j of word i allows token 32 * i + j
    row_indices: torch.Tensor | None = None,  # [k] int64: logits row of each bitmask row
) -> None:
    apply_token_bitmask_torch(logits, bitmask, row_indices)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, words] int32 -> [k, vocab] bool, True = allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [k, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask_torch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None = None,
) -> None:
    vocab = logits.shape[1]
    disallowed = ~unpack_bitmask(bitmask, vocab)  # [k, vocab]
    if row_indices is None:
        logits[: bitmask.shape[0]].masked_fill_(disallowed, float("-inf"))
    else:
        rows = logits.index_select(0, row_indices).masked_fill_(disallowed, float("-inf"))
        logits.index_copy_(0, row_indices, rows)

