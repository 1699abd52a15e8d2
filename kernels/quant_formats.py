"""Quantised weight formats: what the bytes mean, independent of any kernel.

A ``QuantWeight`` is a linear layer's weight [N, K] kept quantised: each of its N rows is
a run of blocks along K in one of the GGUF formats (the file's own bytes, unchanged), or,
for ``INT8_ROW``, K int8 values with one fp32 scale per row (made at load from a
float model, ``--quantization int8``). The C kernels (``kernels.cpu_quant``) repack these
bytes for speed but keep every quantised value and scale as they are; ``dequantize`` here
is the reference they and the tests compare against, and it reproduces ``gguf``'s own
dequantiser bit for bit (a float32 multiply, then an add, no fused multiply-add).

Block layouts (32 weights per block, little-endian, scales as IEEE half):
- ``Q8_0``: d:f16, q:int8[32]                 → w = d·q
- ``Q4_0``: d:f16, nibbles:u8[16]             → w = d·(q − 8)
- ``Q4_1``: d:f16, m:f16, nibbles:u8[16]      → w = d·q + m
  (nibble byte j holds weight j in its low half and weight j + 16 in its high half)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block in every GGUF format here


class QuantFormat(enum.Enum):
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    INT8_ROW = "int8"  # per-output-channel int8, fp32 scale per row

    @property
    def block_bytes(self) -> int:
        """Bytes per 32 weights (INT8_ROW: 32, its row scale kept apart)."""
        return {"q8_0": 34, "q4_0": 18, "q4_1": 20, "int8": 32}[self.value]

    @property
    def ggml_type(self) -> int | None:
        """The GGML type id in a GGUF file (None: not a GGUF format)."""
        return {"q8_0": 8, "q4_0": 2, "q4_1": 3, "int8": None}[self.value]

    def row_bytes(self, k: int) -> int:
        if self is QuantFormat.INT8_ROW:
            return k
        if k % BLOCK:
            raise ValueError(f"a quantised row needs a multiple of {BLOCK} columns, got {k}")
        return k // BLOCK * self.block_bytes

    @classmethod
    def from_ggml_type(cls, type_id: int) -> QuantFormat | None:
        """The format of a GGML type id, or None when it is not one we run natively."""
        return next((f for f in cls if f.ggml_type == type_id), None)


@dataclass(frozen=True, slots=True, eq=False)
class QuantWeight:
    """A weight [n, k] in ``fmt``: ``data`` uint8 [n, row_bytes]; ``scales`` fp32 [n]
    for INT8_ROW (None otherwise)."""

    fmt: QuantFormat
    n: int
    k: int
    data: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (self.n, self.fmt.row_bytes(self.k)):
            raise ValueError(f"{self.fmt.name} data must be uint8 [{self.n}, {self.fmt.row_bytes(self.k)}], "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")
        if (self.scales is not None) != (self.fmt is QuantFormat.INT8_ROW):
            raise ValueError("scales are given exactly for INT8_ROW")
        if self.scales is not None and tuple(self.scales.shape) != (self.n,):
            raise ValueError(f"INT8_ROW scales must be [{self.n}], got {tuple(self.scales.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads."""
        return self.data.numel() + (0 if self.scales is None else 4 * self.n)

    def rows(self, index: torch.Tensor | list[int]) -> QuantWeight:
        """The weight made of the given rows (a row permutation is exact on quantised
        rows: blocks run along k)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        scales = None if self.scales is None else self.scales[idx].contiguous()
        return QuantWeight(self.fmt, len(idx), self.k, self.data[idx].contiguous(), scales)

    def dequantize(self) -> torch.Tensor:
        """fp32 [n, k], bit-identical to ``gguf.quants.dequantize`` for GGUF formats."""
        if self.fmt is QuantFormat.INT8_ROW:
            return self.data.view(torch.int8).float() * self.scales[:, None]
        blocks = self.data.reshape(self.n, self.k // BLOCK, self.fmt.block_bytes)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, kb, 1]
        if self.fmt is QuantFormat.Q8_0:
            w = blocks[..., 2:].contiguous().view(torch.int8).float() * d
        else:
            nib = blocks[..., 4:] if self.fmt is QuantFormat.Q4_1 else blocks[..., 2:]
            q = torch.cat((nib & 0x0F, nib >> 4), dim=-1).float()  # [n, kb, 32]
            if self.fmt is QuantFormat.Q4_0:
                w = (q - 8) * d
            else:
                m = blocks[..., 2:4].contiguous().view(torch.float16).float()
                w = d * q + m
        return w.reshape(self.n, self.k)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """The weights stacked along n (fused q|k|v, gate|up); formats and k must agree."""
    first = parts[0]
    if any(p.fmt is not first.fmt or p.k != first.k for p in parts):
        raise ValueError("only weights of one format and width can be fused")
    scales = None if first.scales is None else torch.cat([p.scales for p in parts])
    return QuantWeight(first.fmt, sum(p.n for p in parts), first.k,
                       torch.cat([p.data for p in parts]), scales)


def quantize_int8_rows(w: torch.Tensor) -> QuantWeight:
    """Per-row symmetric int8 of a float weight [n, k]: scale = absmax / 127."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(QuantFormat.INT8_ROW, w.shape[0], w.shape[1], q.view(torch.uint8),
                       scale.contiguous())
