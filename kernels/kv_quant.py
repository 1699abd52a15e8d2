"""The quantised KV-cache format (``--kv-cache-dtype int8|fp8``) and its torch reference.

Storage. The runner's cache is one byte tensor ``[num_blocks, num_layers, 2, slab]``:
block-major like the float cache, so one block (all layers, K and V, values *and* scales)
is one contiguous buffer — copy-on-write, prefix caching and the KV connector move it as
they move a float block, with no second tensor to keep in step. Each (block, layer, K|V)
slab is ``block_size * kv_heads * head_dim`` one-byte codes (``[BS, KVH, D]``, the float
cache's row order) followed by ``kv_heads`` fp32 scales::

    value(block, tok, head, d) = decode(code[tok, head, d]) * scale[head]

``int8`` codes are two's-complement integers in [-127, 127]; ``fp8`` codes are e4m3fn
bit patterns (``torch.float8_e4m3fn``: round to nearest even, saturated to ±448).

Scales. A block's scale for a head is ``max|x| / QMAX`` over the rows written into it.
The tokens a step writes are taken in *runs*: consecutive slot-mapping entries in one
block, at ascending offsets. A run starting at offset 0 opens the block afresh (whatever
a previous owner left is ignored). Otherwise the rows below the run's first offset are
the block's earlier rows: when the run needs a larger scale, they are requantised to it
(``code' = quantise(decode(code) * old / new)``), which rounds them a second time — an
extra error of at most half a step of the new scale per growth, only for rows written by
earlier steps of a partly filled block (decode tokens; a prefill's full blocks are
quantised once, at their exact scale). A scale never shrinks until the block reopens.

Every implementation (this reference, ``kernels/cpu/kv_cache_quant.c``, the Triton
kernels) does the same fp32 operations in the same order, so their codes agree bit for bit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # one fp32 scale per (block, layer, K|V, kv head)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to nearest even


class KVQuant(enum.Enum):
    INT8 = "int8"
    FP8 = "fp8"

    @property
    def qmax(self) -> float:
        return 127.0 if self is KVQuant.INT8 else 448.0


def parse_kv_quant(name: str) -> KVQuant | None:
    """The quantised format of a ``--kv-cache-dtype`` value, None for the float ones."""
    return KVQuant(name) if name in ("int8", "fp8") else None


@dataclass(frozen=True, slots=True)
class QuantizedCache:
    """One layer's K (or V) of a quantised cache: views into the runner's byte tensor."""

    codes: torch.Tensor  # [NB, BS, KVH, D] uint8, inner three dims contiguous
    scales: torch.Tensor  # [NB, KVH] float32, strided in the block dim
    fmt: KVQuant

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def slab_nbytes(block_size: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one (block, layer, K|V) slab: codes, then the per-head scales."""
    return block_size * kv_heads * head_dim + SCALE_BYTES * kv_heads


def block_nbytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int) -> int:
    return num_layers * 2 * slab_nbytes(block_size, kv_heads, head_dim)


def layer_views(storage: torch.Tensor, block_size: int, kv_heads: int, head_dim: int,
                fmt: KVQuant) -> list[tuple[QuantizedCache, QuantizedCache]]:
    """(K, V) views of each layer of ``storage`` [NB, L, 2, slab] uint8."""
    nb, layers, _, slab = storage.shape
    ncodes = block_size * kv_heads * head_dim
    if slab != slab_nbytes(block_size, kv_heads, head_dim) or ncodes % SCALE_BYTES:
        raise ValueError(f"slab of {slab} bytes does not hold [{block_size}, {kv_heads}, "
                         f"{head_dim}] codes plus fp32 scales at an aligned offset")

    def view(layer: int, kv: int) -> QuantizedCache:
        s = storage[:, layer, kv]  # [NB, slab], strided in the block dim
        codes = s[:, :ncodes].view(nb, block_size, kv_heads, head_dim)
        return QuantizedCache(codes, s[:, ncodes:].view(torch.float32), fmt)

    return [(view(i, 0), view(i, 1)) for i in range(layers)]


class LayerViews:
    """What the model indexes as ``kv_cache[:, layer, 0 | 1]``: that layer's K or V view.

    The model slices a float cache tensor that way; a quantised cache hands it this
    instead, so the model code is the same for both and the backend gets codes + scales.
    """

    def __init__(self, views: list[tuple[QuantizedCache, QuantizedCache]]) -> None:
        self._views = views

    def __getitem__(self, key: tuple[slice, int, int]) -> QuantizedCache:
        blocks, layer, kv = key
        if blocks != slice(None):
            raise IndexError("a quantised cache is indexed as [:, layer, k_or_v]")
        return self._views[layer][kv]


# ---- element conversions -----------------------------------------------------------


def _rint(y: torch.Tensor) -> torch.Tensor:
    return (y + _ROUND_MAGIC) - _ROUND_MAGIC


def encode(y: torch.Tensor, fmt: KVQuant) -> torch.Tensor:
    """fp32 values already divided by their scale -> uint8 codes (saturating)."""
    y = y.float().clamp(-fmt.qmax, fmt.qmax)
    if fmt is KVQuant.INT8:
        return _rint(y).to(torch.int8).view(torch.uint8)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def decode(codes: torch.Tensor, fmt: KVQuant) -> torch.Tensor:
    """uint8 codes -> fp32 values before scaling."""
    if fmt is KVQuant.INT8:
        return codes.view(torch.int8).float()
    return codes.view(torch.float8_e4m3fn).float()


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: KVQuant) -> torch.Tensor:
    """x [..., D] fp32 at per-row ``scale`` [...] -> codes; a zero scale gives zero codes."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return encode(torch.where((scale > 0)[..., None], x.float() / safe[..., None], 0.0), fmt)


def scale_for(x: torch.Tensor, fmt: KVQuant) -> torch.Tensor:
    """The scale that maps max|x| over the last dim to QMAX: x [..., D] -> [...]."""
    return x.float().abs().amax(dim=-1) / fmt.qmax


def dequantize_blocks(cache: QuantizedCache, block_ids: torch.Tensor) -> torch.Tensor:
    """The fp32 values of whole blocks: [nb, BS, KVH, D]."""
    ids = block_ids.long()
    codes = cache.codes.index_select(0, ids)
    return decode(codes, cache.fmt) * cache.scales.index_select(0, ids)[:, None, :, None]


def gather_kv(cache: QuantizedCache, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` positions of one sequence, dequantised: [n, KVH, D] fp32."""
    return dequantize_blocks(cache, block_ids).flatten(0, 1)[:num_tokens]


# ---- cache write ----------------------------------------------------------------------


def runs(slot_mapping: torch.Tensor, block_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive tokens whose slots share a block."""
    blocks = (slot_mapping.long() // block_size).tolist()
    if not blocks:
        return []
    bounds = [0] + [t for t in range(1, len(blocks)) if blocks[t] != blocks[t - 1]]
    return list(zip(bounds, bounds[1:] + [len(blocks)], strict=True))


def write_run(x: torch.Tensor, cache: QuantizedCache, block: int, first: int,
              offsets: torch.Tensor) -> None:
    """Quantise one run's rows x [n, KVH, D] into ``block`` at ``offsets`` (first = offsets[0])."""
    fmt = cache.fmt
    need = scale_for(x, fmt).amax(dim=0)  # [KVH]
    old = cache.scales[block]
    if first == 0:
        new = need
    else:
        new = torch.maximum(old, need)
        grown = new > old
        if bool(grown.any()):
            earlier = cache.codes[block, :first]  # [first, KVH, D]
            values = decode(earlier, fmt) * old[None, :, None]
            requant = quantize(values, new[None, :].expand(first, -1), fmt)
            cache.codes[block, :first] = torch.where(grown[None, :, None], requant, earlier)
    cache.scales[block] = new
    cache.codes[block, offsets] = quantize(x, new[None, :].expand(x.shape[0], -1), fmt)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: QuantizedCache,
             v_cache: QuantizedCache, slot_mapping: torch.Tensor) -> None:
    """``kernels.reference.write_kv`` for a quantised cache, with the scale rule above."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    for start, stop in runs(slots, block_size):
        block = int(slots[start]) // block_size
        offsets = slots[start:stop] % block_size
        first = int(offsets[0])
        write_run(key[start:stop].float(), k_cache, block, first, offsets)
        write_run(value[start:stop].float(), v_cache, block, first, offsets)


# ---- attention over a quantised cache (oracle) -------------------------------------------


def paged_decode_attention(q, k_cache: QuantizedCache, v_cache: QuantizedCache,
                           block_tables, context_lens, scale: float) -> torch.Tensor:
    """``kernels.reference.paged_decode_attention`` over the dequantised blocks."""
    from kernels import reference

    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    for i, n in enumerate(context_lens.tolist()):
        if n == 0:  # nothing to attend to: zeros, as the kernels return
            out[i] = 0.0
            continue
        ids = block_tables[i, : -(-n // block_size)]
        own = torch.arange(len(ids)).unsqueeze(0)  # the sequence's blocks, renumbered
        out[i : i + 1] = reference.paged_decode_attention(
            q[i : i + 1], dequantize_blocks(k_cache, ids), dequantize_blocks(v_cache, ids),
            own, context_lens[i : i + 1], scale)
    return out


def paged_prefill_attention(q, k_cache: QuantizedCache, v_cache: QuantizedCache, block_tables,
                            query_start, context_lens, scale: float) -> torch.Tensor:
    """``kernels.reference.paged_prefill_attention`` over the dequantised cache."""
    from kernels import reference

    ids = torch.arange(k_cache.shape[0])
    return reference.paged_prefill_attention(
        q, dequantize_blocks(k_cache, ids), dequantize_blocks(v_cache, ids), block_tables,
        query_start, context_lens, scale)
