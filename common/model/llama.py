"""The Llama-family transformer over a paged KV cache (Llama, SmolLM2, Mistral, Qwen2).

The forward pass takes a step's tokens flattened into one batch (no padding), so GEMMs
see every token of every sequence at once; only attention cares where one sequence ends
and the next begins, and that is the attention backend's business (``kernels.attention``).
Projections are fused (q|k|v and gate|up) to halve the number of GEMM launches. On a
CPU in float32 ``use_cpu_kernels()`` repacks every projection once for our GEMM kernel
(``kernels/cpu/packed_gemm.c``: 1.1-1.9x MKL here, most at decode batch sizes), frees the
originals, and fuses the elementwise steps (``kernels/cpu/fused_ops.c``: residual add +
RMSNorm, RoPE, SiLU x up) into one pass each.

Weights may also be held quantised (``quantize``, called by the loader in the gguf and
int8 modes, see ``common.model.quantization``): on a CPU those run through
``kernels.cpu_quant``, elsewhere (CUDA) as the format's own bytes through the Triton GEMM
``kernels.triton_quant``; a quantised embedding is looked up there too, and a tied LM
head shares its quantised form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from common.model.spec import ModelSpec
from kernels import cpu_decode, cpu_gemm, cpu_ops, cpu_quant
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.cpu_gemm import PackedWeight
from kernels.cpu_quant import QuantPacked
from kernels.quant_formats import QuantWeight

# a projection as the forward pass holds it (QuantWeight: on the Triton path, kernels.triton_quant)
Weight = torch.Tensor | PackedWeight | QuantPacked | QuantWeight

# Below this many rows, MKL computes ``weight @ x.T`` faster than ``x @ weight.T`` on this
# class of CPU (measured: 1.5-2.5x at 2-4 rows, 1.2x at 64 with 2 threads, even at 256),
# so small batches get the transposed product; its result is a transposed view, which
# every op here accepts. A single row with several threads goes through MKL's GEMV,
# slower than its GEMM on two rows (1.1-1.3x), so it is duplicated; with one thread the
# plain product is best for a single row. (Only without the packed kernel, see below.)
SMALL_BATCH_ROWS = 256


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K] (or its packed or quantised form) → [T, N]."""
    if isinstance(weight, PackedWeight):
        return cpu_gemm.linear(x, weight, bias)
    if isinstance(weight, QuantPacked):
        return cpu_quant.linear(x, weight, bias)  # strided rows are read in place
    if isinstance(weight, QuantWeight):
        from kernels import triton_quant  # triton: only where quantised weights run on it

        return triton_quant.linear(x, weight, bias)
    rows = x.shape[0]
    if x.device.type != "cpu" or rows > SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    if rows == 1:
        if torch.get_num_threads() == 1:
            return F.linear(x, weight, bias)
        y = torch.mm(weight, torch.cat((x, x)).t())[:, :1].t()
    else:
        y = torch.mm(weight, x.t()).t()
    return y if bias is None else y + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, C], normalised over C in fp32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:  # [D/2]
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: Mapping) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos: [T, 1, D] (cos, cos); sin: [T, 1, D] (-sin, sin).

    Rotates the two halves of each head: (x1, x2) → (x1 cos - x2 sin, x2 cos + x1 sin),
    the same products as the reference implementation, so results are bit-identical.
    """
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaModel(torch.nn.Module):
    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        s = spec
        p = lambda *shape: torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),  # noqa: E731
                                              requires_grad=False)
        self.embed = p(s.vocab_size, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else p(s.vocab_size, s.hidden_size)
        self.norm = p(s.hidden_size)
        self.layers = torch.nn.ModuleList(_Layer(s, p) for _ in range(s.num_layers))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(s))
        cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("rope_cos", torch.cat((cos, cos), -1).to(device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("rope_sin", torch.cat((-sin, sin), -1).to(device=device, dtype=dtype),
                             persistent=False)
        self.scale = s.head_dim**-0.5
        self.packed_lm_head: PackedWeight | QuantPacked | None = None
        self.quantized: dict[str, QuantPacked | QuantWeight] = {}  # see quantize
        self.fused_ops = False  # see use_cpu_kernels
        self.decode_loop = True  # decode steps in one C call where possible (_decode_loop)
        self._loop: cpu_decode.DecodeLayers | None = None

    def quantize(self, weights: Mapping[str, QuantWeight], triton: bool | None = None) -> None:
        """Hold these weights quantised, by parameter name (``embed``, ``lm_head`` when
        untied, ``layers.N.{qkv,o,gate_up,down}``), freeing their float copies; a tied LM
        head shares the quantised embedding. On a CPU they are packed for the C kernels
        (call before ``use_cpu_kernels``); on another device, or with ``triton=True``
        (Triton's interpreter on a CPU, for tests), they stay the format's bytes on the
        model's device for ``kernels.triton_quant``."""
        for name, w in weights.items():
            param = self.get_parameter(name)
            if name == "lm_head" and param is self.embed:
                raise ValueError("a tied LM head is the embedding: quantise embed")
            if (w.n, w.k) != tuple(param.shape):
                raise ValueError(f"{name}: quantised [{w.n}, {w.k}], expected {tuple(param.shape)}")
        device = self.embed.device
        on_triton = device.type != "cpu" if triton is None else triton
        if on_triton:
            from kernels import triton_quant

            held: list[QuantPacked | QuantWeight] = [triton_quant.to_device(w, device)
                                                     for w in weights.values()]
        else:
            # one arena on huge pages: a decode step streams every weight, and scattered
            # 4 KiB pages would cost it TLB misses
            held = cpu_quant.pack_all(list(weights.values()))
        for (name, _), p in zip(weights.items(), held, strict=True):
            param = self.get_parameter(name)
            self.quantized[name] = p
            param.data = torch.empty(0, device=device, dtype=param.dtype)
        if self.lm_head is self.embed and "embed" in self.quantized:
            self.quantized["lm_head"] = self.quantized["embed"]
        if on_triton:
            self._hold_for_triton()

    def _hold_for_triton(self) -> None:
        """Each layer's projections as the forward pass takes them: quantised where they
        are, the float parameters elsewhere; the LM head likewise."""
        names = _PackedLayer._fields
        for i, layer in enumerate(self.layers):
            layer.packed = _PackedLayer(*(self.quantized.get(f"layers.{i}.{n}", getattr(layer, n))
                                          for n in names))
        self.packed_lm_head = self.quantized.get("lm_head")

    def use_cpu_kernels(self) -> list[str]:
        """On a CPU in float32, with the C kernels built: repack every float projection and
        the LM head for the GEMM kernel, freeing the originals (the embedding stays: a tied
        LM head packs a copy), and run the elementwise steps fused. Returns what it
        enabled, for the log."""
        if self.embed.device.type != "cpu" or self.embed.dtype != torch.float32 or \
                any(isinstance(w, QuantWeight) for w in self.quantized.values()):
            return []  # (quantised weights held for Triton stay there)
        if self.packed_lm_head is None and cpu_gemm.available():
            self._pack()
        elif self.packed_lm_head is None and self.quantized:
            raise RuntimeError(f"quantised weights need the CPU GEMM kernel for the float ones: "
                               f"{cpu_gemm.unavailable_reason()}")
        # the fused ops want contiguous rows, which both kernels' outputs are
        self.fused_ops = self.packed_lm_head is not None and cpu_ops.available()
        return self.cpu_kernels

    def _pack(self) -> None:
        names = _PackedLayer._fields
        slots = [f"layers.{i}.{n}" for i in range(len(self.layers)) for n in names] + ["lm_head"]
        floats = [slot for slot in slots if slot not in self.quantized]
        packed: dict[str, Weight] = dict(self.quantized)
        if floats:
            packed.update(zip(floats, cpu_gemm.pack_all([self.get_parameter(f) for f in floats]),
                              strict=True))  # fmt: skip
        for i, layer in enumerate(self.layers):
            layer.packed = _PackedLayer(*(packed[f"layers.{i}.{n}"] for n in names))
            for name in names:
                getattr(layer, name).data = torch.empty(0)
        self.packed_lm_head = packed["lm_head"]
        if self.lm_head is not self.embed:
            self.lm_head.data = torch.empty(0)

    def _held(self) -> tuple[list[Weight], Weight]:
        """Every projection and the LM head, as the forward pass holds them."""
        head = self.packed_lm_head if self.packed_lm_head is not None else self.lm_head
        names = _PackedLayer._fields
        return [getattr(layer.packed or layer, n) for layer in self.layers for n in names], head

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection (with its bias) and the
        LM head, as held (packed, quantised); the embedding lookup is not counted."""
        projections, head = self._held()
        biases = [b for layer in self.layers for b in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias,
                                                       layer.down_bias) if b is not None]  # fmt: skip
        return sum(_nbytes(w) for w in [*projections, head, *biases])

    def describe_weights(self) -> str:
        """The weights as held, for logs, e.g. "gguf Q4_1 (+Q8_0 head), 96.4 MB per step"."""
        projections, head = self._held()
        by_kind: dict[str, int] = {}
        for w in projections:
            by_kind[_kind(w)] = by_kind.get(_kind(w), 0) + _nbytes(w)
        kinds = "+".join(sorted(by_kind, key=by_kind.__getitem__, reverse=True))
        gguf = any(w.fmt.value != "int8" for w in self.quantized.values())  # int8, fp32 say so
        return f"{'gguf ' * gguf}{kinds} (+{_kind(head)} head), {self.weight_bytes() / 1e6:.3g} MB per step"

    @property
    def cpu_kernels(self) -> list[str]:
        """The C kernels the forward pass uses."""
        projections, head = self._held()
        packed = any(isinstance(w, PackedWeight) for w in [*projections, head])
        quant = [f"quantised GEMM ({cpu_quant.isa()})"] if self.quantized else []  # the path it takes
        return ["packed GEMM"] * packed + quant + ["fused ops"] * self.fused_ops

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [NB, L, 2, BS, KVH, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        loop = self._decode_loop(kv_cache, meta, backend, x.shape[0])
        if loop is not None:
            return loop.run(x, positions, meta.slot_mapping, meta.decode_block_tables,
                            meta.decode_context_lens, torch.get_num_threads())
        if self.fused_ops:
            delta = None  # each layer's output, added into x by the next
            positions = positions.contiguous()
            for i, layer in enumerate(self.layers):
                delta = layer.forward_fused(x, delta, positions, self.rope_cos, self.rope_sin,
                                            kv_cache[:, i, 0], kv_cache[:, i, 1], meta, backend,
                                            self.scale)  # fmt: skip
            return x if delta is None else x.add_(delta)
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[:, i, 0], kv_cache[:, i, 1], meta, backend, self.scale)
        return x

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids → [T, hidden]: rows of the embedding, dequantised where it is held quantised."""
        q = self.quantized.get("embed")
        if q is None:
            return F.embedding(input_ids, self.embed)
        if isinstance(q, QuantPacked):
            return cpu_quant.embedding(q, input_ids)
        from kernels import triton_quant

        return triton_quant.embedding(q, input_ids, self.embed.dtype)

    def _decode_loop(self, kv_cache, meta: AttentionMetadata, backend: AttentionBackend,
                     num_tokens: int) -> cpu_decode.DecodeLayers | None:
        """The one-call C loop over the layers (``kernels.cpu_decode``) when it computes
        exactly what the fused path would: decode rows only, a float32 cache, the fused C
        kernels throughout; else None."""
        if not (self.decode_loop and self.fused_ops and not meta.prefills
                and meta.num_decode == num_tokens and getattr(backend, "c_decode_f32", False)
                and isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.float32):
            return None
        loop = self._loop
        if loop is None or not loop.bound_to(kv_cache):
            if not cpu_decode.available():
                self.decode_loop = False
                return None
            loop = self._loop = cpu_decode.DecodeLayers(self, kv_cache)
        return loop

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] of the positions to sample from → [S, vocab] fp32 logits."""
        head = self.packed_lm_head if self.packed_lm_head is not None else self.lm_head
        logits = linear(rms_norm(hidden, self.norm, self.spec.rms_norm_eps), head)
        return logits.float().contiguous()


class _Layer(torch.nn.Module):
    def __init__(self, s: ModelSpec, p) -> None:
        super().__init__()
        self.s = s
        self.input_norm = p(s.hidden_size)
        self.qkv = p(s.q_size + 2 * s.kv_size, s.hidden_size)
        self.qkv_bias = p(s.q_size + 2 * s.kv_size) if s.qkv_bias else None
        self.o = p(s.hidden_size, s.q_size)
        self.o_bias = p(s.hidden_size) if s.o_bias else None
        self.post_norm = p(s.hidden_size)
        self.gate_up = p(2 * s.intermediate_size, s.hidden_size)
        self.gate_up_bias = p(2 * s.intermediate_size) if s.mlp_bias else None
        self.down = p(s.hidden_size, s.intermediate_size)
        self.down_bias = p(s.hidden_size) if s.mlp_bias else None
        self.packed: _PackedLayer | None = None

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend, scale) -> torch.Tensor:
        s = self.s
        w = self.packed or self  # the four projections, packed or not
        num_tokens = x.shape[0]
        qkv = linear(rms_norm(x, self.input_norm, s.rms_norm_eps), w.qkv, self.qkv_bias)
        # q and k are rotated together: one pass over [T, H + KVH, D].
        qk = apply_rope(qkv[:, : s.q_size + s.kv_size].unflatten(-1, (-1, s.head_dim)), cos, sin)
        q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        v = qkv[:, s.q_size + s.kv_size :].unflatten(-1, (s.num_kv_heads, s.head_dim))
        attn = backend.forward(q.contiguous(), k, v, k_cache, v_cache, meta, scale)
        x = x + linear(attn.reshape(num_tokens, s.q_size), w.o, self.o_bias)
        gate, up = linear(rms_norm(x, self.post_norm, s.rms_norm_eps), w.gate_up,
                          self.gate_up_bias).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, w.down, self.down_bias)

    def forward_fused(self, x, delta, positions, cos, sin, k_cache, v_cache, meta, backend, scale):
        """forward() by the fused CPU ops on packed weights: adds ``delta`` (the previous
        layer's output; None for the first) into the residual stream ``x`` in place and
        returns this layer's output. The same arithmetic as forward()."""
        s, w = self.s, self.packed
        h = cpu_ops.add_rms_norm(x, delta, self.input_norm, s.rms_norm_eps)
        qkv = linear(h, w.qkv, self.qkv_bias)
        q, k = cpu_ops.rope_qk(qkv, positions, cos, sin, s.num_heads, s.num_kv_heads)
        v = qkv[:, s.q_size + s.kv_size :].unflatten(-1, (s.num_kv_heads, s.head_dim))
        attn = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        o = linear(attn.reshape(x.shape[0], s.q_size), w.o, self.o_bias)
        h = cpu_ops.add_rms_norm(x, o, self.post_norm, s.rms_norm_eps)
        act = cpu_ops.silu_mul(linear(h, w.gate_up, self.gate_up_bias))
        return linear(act, w.down, self.down_bias)


class _PackedLayer(NamedTuple):
    qkv: Weight
    o: Weight
    gate_up: Weight
    down: Weight


def _nbytes(w: Weight) -> int:
    if isinstance(w, QuantPacked | QuantWeight):
        return w.nbytes
    data = w.data if isinstance(w, PackedWeight) else w
    return data.numel() * data.element_size()


def _kind(w: Weight) -> str:
    """A weight's number format: Q4_1, int8, fp32, ..."""
    if isinstance(w, QuantPacked | QuantWeight):
        return "int8" if w.fmt.value == "int8" else w.fmt.name
    dtype = w.data.dtype if isinstance(w, PackedWeight) else w.dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
