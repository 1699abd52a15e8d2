"""STAND-IN for the quantised CPU kernels (``kernels/cpu/quant_gemm.c``): the same API,
in plain torch, so the model, loader and tests can be wired before the C kernel lands.

``pack`` keeps the ``QuantWeight`` and a dequantised fp32 copy (so this stand-in saves no
memory); ``linear`` is ``F.linear`` on that copy and ``embedding`` indexes it. The real
module replaces this file wholesale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant_formats import QuantFormat, QuantWeight


def available() -> bool:
    """Whether the kernel can run (the stand-in always can)."""
    return True


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, else None."""
    return None


class QuantPacked:
    """A quantised weight [n, k] as the kernel holds it."""

    __slots__ = ("weight", "dense")

    def __init__(self, weight: QuantWeight) -> None:
        self.weight = weight
        self.dense = weight.dequantize()

    @property
    def fmt(self) -> QuantFormat:
        return self.weight.fmt

    @property
    def n(self) -> int:
        return self.weight.n

    @property
    def k(self) -> int:
        return self.weight.k

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __repr__(self) -> str:
        return f"QuantPacked({self.fmt.name}, n={self.n}, k={self.k})"


def pack(w: QuantWeight) -> QuantPacked:
    return QuantPacked(w)


def linear(x: torch.Tensor, w: QuantPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.dequantize().T + bias``: [M, N] fp32, contiguous."""
    return F.linear(x, w.dense, bias).contiguous()


def embedding(w: QuantPacked, ids: torch.Tensor) -> torch.Tensor:
    """The dequantised rows ``ids`` of ``w``: [T, k] fp32."""
    return w.dense[ids]
