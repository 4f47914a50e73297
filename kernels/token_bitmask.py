"""Apply a packed grammar bitmask to logits: disallowed tokens get -inf."""

import sys

import torch
from batchwire.kernels._checks import check_tensor
from batchwire.kernels._triton import tl, triton
from batchwire.kernels.backend import use_triton


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    bitmask: torch.Tensor,  # [k, ceil(vocab / 32)] int32; bit j of word i allows token 32 * i + j
    row_indices: torch.Tensor | None = None,  # [k] int64: logits row of each bitmask row
) -> None:
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, row_indices)
    else:
        apply_token_bitmask_torch(logits, bitmask, row_indices)


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: row b holds the bits of byte value b, lowest first."""
    if device not in _BYTE_BITS:
        values = torch.arange(256, dtype=torch.int32, device=device)
        shifts = torch.arange(8, dtype=torch.int32, device=device)
        _BYTE_BITS[device] = ((values[:, None] >> shifts) & 1).bool()
    return _BYTE_BITS[device]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, words] int32 -> [k, vocab] bool, True = allowed."""
    k, words = bitmask.shape
    if words * 32 < vocab:
        raise ValueError(
            f"bitmask has {words} words a row; a vocab of {vocab} needs {-(-vocab // 32)}"
        )
    if sys.byteorder == "little":
        # Byte i of word w holds tokens 32w + 8i ...: one table lookup per byte, not 32 shifts
        # of the whole int32 mask (4x less memory traffic on CPU).
        data = bitmask.contiguous().view(torch.uint8).reshape(-1).int()  # [k * words * 4]
        bits = _byte_bits(bitmask.device).index_select(0, data)  # [k * words * 4, 8]
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool()  # [k, words, 32]
    return bits.view(k, words * 32)[:, :vocab]


def apply_token_bitmask_torch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None = None,
) -> None:
    vocab = logits.shape[1]
    if bitmask.shape[0] == 0:
        return
    disallowed = ~unpack_bitmask(bitmask, vocab)  # [k, vocab]
    if row_indices is None:
        logits[: bitmask.shape[0]].masked_fill_(disallowed, float("-inf"))
    else:
        rows = logits.index_select(0, row_indices).masked_fill_(disallowed, float("-inf"))
        logits.index_copy_(0, row_indices, rows)


@triton.jit
def _token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    row_indices_ptr,
    vocab,
    stride_logits,
    stride_bitmask,
    HAS_ROW_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    mask_row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    if HAS_ROW_INDICES:
        row = tl.load(row_indices_ptr + mask_row)
    else:
        row = mask_row.to(tl.int64)
    in_vocab = tokens < vocab
    words = tl.load(bitmask_ptr + mask_row * stride_bitmask + tokens // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None = None,
) -> None:
    check_tensor("logits", logits, 2, (torch.float32,))
    num_rows, vocab = logits.shape
    check_tensor("bitmask", bitmask, 2, (torch.int32,), logits.device)
    k, words = bitmask.shape
    if words != triton.cdiv(vocab, 32):
        need = triton.cdiv(vocab, 32)
        raise ValueError(f"bitmask has {words} words a row; a vocab of {vocab} needs {need}")
    if row_indices is not None:
        check_tensor("row_indices", row_indices, 1, (torch.int64,), logits.device, False)
        if row_indices.shape[0] != k:
            raise ValueError(f"row_indices has {row_indices.shape[0]} entries, bitmask {k} rows")
    elif k > num_rows:
        raise ValueError(f"bitmask has {k} rows but logits only {num_rows}")
    if k == 0:
        return
    block = 1024
    _token_bitmask_kernel[(k, triton.cdiv(vocab, block))](
        logits,
        bitmask,
        row_indices if row_indices is not None else bitmask,
        vocab,
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROW_INDICES=row_indices is not None,
        BLOCK=block,
    )
