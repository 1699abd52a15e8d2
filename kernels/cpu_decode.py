"""Every layer of a decode step in one C call (``kernels/cpu/decode_layers.c``).

``DecodeLayers`` holds, once per model and cache, what the C loop needs: the addresses
of the kernels the Python path launches (quantised and packed GEMM, the fused
elementwise ops, float32 paged decode attention, each from its own library) and of every
layer's weights and cache views. ``run`` then does one step's layers for decode rows
only, with exactly the launches of ``LlamaModel.forward`` on the fused path, so the
results are bit-identical to it (tests/test_cpu_decode.py); the saving is the Python
around some 330 launches a step. ``available()`` says whether every library built.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch  # must be loaded before the kernel library, see kernels.cpu_build

from kernels import cpu_attention, cpu_build, cpu_gemm, cpu_ops, cpu_quant
from kernels.cpu_gemm import PackedWeight
from kernels.cpu_quant import QuantPacked

SOURCE = Path(__file__).parent / "cpu" / "decode_layers.c"

_i64, _ptr, _f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Proj(ctypes.Structure):
    _fields_ = [("fmt", _i64), ("w", _ptr), ("bias", _ptr), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Proj), ("o", _Proj),
                ("gate_up", _Proj), ("down", _Proj), ("k_cache", _ptr), ("v_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("quant_linear", _ptr), ("packed_linear", _ptr), ("add_rms_norm", _ptr),
                ("silu_mul", _ptr), ("rope_qk", _ptr), ("attention", _ptr),
                ("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("eps", _f), ("scale", _f),
                ("cos", _ptr), ("sin", _ptr), ("max_pos", _i64), ("num_blocks", _i64),
                ("block_size", _i64), ("block_stride", _i64), ("layers", _ptr)]


class _Step(ctypes.Structure):
    _fields_ = [("T", _i64), ("x", _ptr), ("positions", _ptr), ("slots", _ptr),
                ("block_tables", _ptr), ("bt_stride", _i64), ("max_blocks", _i64),
                ("context_lens", _ptr), ("scratch", _ptr), ("threads", _i64)]


@dataclass(frozen=True)
class _Kernel:
    run: ctypes._CFuncPtr
    scratch: ctypes._CFuncPtr


def _open(_variant: None) -> _Kernel:
    lib = cpu_build.load(cpu_build.library_path(SOURCE, "decode_layers"), "CPU decode layers")
    run, scratch = lib.decode_layers, lib.decode_layers_scratch
    run.argtypes, run.restype = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)], ctypes.c_int
    scratch.argtypes, scratch.restype = [ctypes.POINTER(_Model), ctypes.c_long], ctypes.c_long
    return _Kernel(run, scratch)


_loader = cpu_build.Loader("CPU decode layers", _open)  # one variant: key None


def available() -> bool:
    """Whether this loop and every kernel it calls built and loaded."""
    return (_loader.get(None) is not None and cpu_ops.available() and cpu_gemm.available()
            and cpu_attention.available(torch.float32))


def _address(fn: ctypes._CFuncPtr | None) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def _proj(w: PackedWeight | QuantPacked, bias: torch.Tensor | None) -> _Proj:
    b = None if bias is None else bias.data_ptr()
    if isinstance(w, QuantPacked):
        return _Proj(cpu_quant.format_code(w.fmt), w.data.data_ptr(), b, w.n, w.k)
    if isinstance(w, PackedWeight):
        n, k = w.shape
        return _Proj(-1, w.data.data_ptr(), b, n, k)
    raise TypeError(f"the C decode loop takes packed or quantised weights, not {type(w).__name__}")


class DecodeLayers:
    """The decode loop bound to one model's layers and one float32 cache
    ``[NB, L, 2, BS, KVH, D]``. Keeps references to everything whose address it holds."""

    def __init__(self, model, kv_cache: torch.Tensor) -> None:
        if kv_cache.dtype is not torch.float32 or not kv_cache.is_contiguous():
            raise ValueError("the C decode loop takes a contiguous float32 cache")
        s = model.spec
        nb, num_layers, _, bs, kvh, d = kv_cache.shape
        self._kernel = _loader.require(None)
        self._cache = kv_cache
        self._keep = [model.rope_cos, model.rope_sin]  # tensors whose addresses are held
        layers = (_Layer * num_layers)()
        for i, (layer, out) in enumerate(zip(model.layers, layers, strict=True)):
            w = layer.packed
            for t in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias):
                if t is not None and not t.is_contiguous():
                    raise ValueError("biases must be contiguous")
            out.input_norm, out.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            out.qkv, out.o = _proj(w.qkv, layer.qkv_bias), _proj(w.o, layer.o_bias)
            out.gate_up = _proj(w.gate_up, layer.gate_up_bias)
            out.down = _proj(w.down, layer.down_bias)
            out.k_cache, out.v_cache = kv_cache[0, i, 0].data_ptr(), kv_cache[0, i, 1].data_ptr()
        self._layers = layers
        ops = cpu_ops.entry_points()
        quant = cpu_quant.entry_points() if model.quantized else None
        self._model = _Model(
            quant_linear=_address(quant.linear if quant else None),
            packed_linear=_address(cpu_gemm.entry_points().linear),
            add_rms_norm=_address(ops.add_rms_norm), silu_mul=_address(ops.silu_mul),
            rope_qk=_address(ops.rope_qk),
            attention=_address(cpu_attention.entry_point(torch.float32)),
            num_layers=num_layers, hidden=s.hidden_size, heads=s.num_heads, kv_heads=kvh,
            head_dim=d, intermediate=s.intermediate_size, eps=s.rms_norm_eps, scale=model.scale,
            cos=model.rope_cos.data_ptr(), sin=model.rope_sin.data_ptr(),
            max_pos=model.rope_cos.shape[0], num_blocks=nb, block_size=bs,
            block_stride=kv_cache.stride(0), layers=ctypes.addressof(layers),
        )  # fmt: skip
        self._hidden = s.hidden_size

    def bound_to(self, kv_cache: torch.Tensor) -> bool:
        return kv_cache is self._cache

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, num_threads: int) -> torch.Tensor:
        """Every layer for T decode rows: ``x`` [T, C] (the embeddings, contiguous) becomes
        the last layer's residual stream in place and is returned; each row's K/V is
        written at its slot. positions and slots: int64 [T]; block_tables int32 [T, W]
        with contiguous rows; context_lens int32 [T]."""
        t = x.shape[0]
        if (x.dtype is not torch.float32 or not x.is_contiguous() or x.shape[1] != self._hidden
                or positions.shape != (t,) or slots.shape != (t,) or context_lens.shape != (t,)
                or block_tables.shape[0] != t):
            raise ValueError("decode rows: mismatched shapes")
        positions = _as(positions, torch.int64)
        slots = _as(slots, torch.int64)
        context_lens = _as(context_lens, torch.int32)
        if block_tables.dtype is not torch.int32 or block_tables.stride(-1) != 1:
            block_tables = block_tables.to(torch.int32).contiguous()
        scratch = torch.empty(self._kernel.scratch(ctypes.byref(self._model), t), dtype=torch.float32)
        step = _Step(t, x.data_ptr(), positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                     block_tables.stride(0), block_tables.shape[1], context_lens.data_ptr(),
                     scratch.data_ptr(), num_threads)
        rc = self._kernel.run(ctypes.byref(self._model), ctypes.byref(step))
        if rc != 0:
            raise ValueError(_reason(rc))
        return x


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype is dtype and t.is_contiguous() else t.to(dtype).contiguous()


_STEPS = ("input norm", "qkv projection", "rotary embedding", "kv write", "attention",
          "o projection", "post norm", "gate/up projection", "silu", "down projection")


def _reason(rc: int) -> str:
    if rc == -1:
        return "decode layers: a bad size or a slot outside the cache"
    layer, step = divmod(-rc - 10, 100)
    return (f"decode layers: layer {layer}'s {_STEPS[step]} rejected its arguments "
            f"(a context longer than its block table, or a block id outside the cache)")
