"""Building what an engine needs at startup: the loaded model and the cache plan.

Loading is separate from the engine so a process can load weights once and build
engines of different shapes on them (tests, benchmarks), and so startup errors (missing
model, unsupported architecture, a cache too small) surface before anything runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.config import EngineConfig, ModelConfig
from common.model import quantization
from common.model.llama import LlamaModel
from common.model.loader import resolve_model
from common.model.spec import ModelSpec, UnsupportedModelError
from common.model.tokenizer import Tokenizer
from kernels import kv_quant
from kernels.attention import AttentionBackend, select_backend
from kernels.kv_quant import KVQuant

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CacheTooSmallError(ValueError):
    pass


@dataclass(slots=True)
class LoadedModel:
    name: str
    spec: ModelSpec
    model: LlamaModel
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    backend: AttentionBackend
    max_len: int  # positions the RoPE tables cover


@dataclass(frozen=True, slots=True)
class CachePlan:
    num_blocks: int
    block_size: int
    dtype: torch.dtype | KVQuant  # a float element type, or a quantised format
    bytes_per_block: int  # all layers, K and V; for a quantised cache codes plus scales
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def resolve_device(cfg: ModelConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":  # fp32 on CPU: without native bf16 it runs 3-7x slower here
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


def load_model(cfg: ModelConfig) -> LoadedModel:
    source = resolve_model(cfg.path)
    spec = ModelSpec.from_hf_config(source.hf_config())
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg.dtype, device)
    max_len = _max_model_len(spec, cfg.max_model_len)
    mode = quantization.resolve_mode(cfg.quantization, source, device, dtype)
    model = LlamaModel(spec, max_len, dtype, device)
    quantization.load(model, source, mode)
    model.use_cpu_kernels()
    log.info("weights: %s", model.describe_weights())
    return LoadedModel(cfg.served_name or source.name, spec, model.eval(),
                       Tokenizer.maybe_load(source.directory), dtype, select_backend(device), max_len)


def _max_model_len(spec: ModelSpec, requested: int | None) -> int:
    limit = spec.max_position_embeddings
    if requested is not None and requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's {limit} positions")
    length = requested or limit
    window = spec.sliding_window
    if window is not None and window < length:
        if requested is not None:
            raise UnsupportedModelError(
                f"sliding-window attention is not supported: use --max-model-len <= {window}")
        log.warning("capping max model len at the sliding window (%d): within it attention is exact", window)
        length = window
    return length


def plan_cache(config: EngineConfig, loaded: LoadedModel) -> CachePlan:
    """How many blocks fit the memory budget, and the context limit they allow."""
    cache = config.cache
    dtype = kv_cache_dtype(cache.kv_cache_dtype, loaded.dtype)
    per_block = block_nbytes(loaded.spec, cache.block_size, dtype)
    num_blocks = cache.num_blocks or cache.memory_bytes // per_block
    capacity = num_blocks * cache.block_size
    max_len = loaded.max_len
    if capacity < max_len:
        if config.model.max_model_len is not None or capacity < 2:
            raise CacheTooSmallError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than "
                f"--max-model-len {max_len}: give it more memory (--kv-cache-memory) or lower the limit")
        log.warning("max model len lowered from %d to the KV cache's %d tokens", max_len, capacity)
        max_len = capacity
    return CachePlan(num_blocks, cache.block_size, dtype, per_block, max_len)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | KVQuant:
    """``--kv-cache-dtype`` resolved: auto = the model's dtype."""
    if name == "auto":
        return model_dtype
    return kv_quant.parse_kv_quant(name) or _DTYPES[name]


def block_nbytes(spec: ModelSpec, block_size: int, dtype: torch.dtype | KVQuant) -> int:
    """Bytes of one cache block (all layers, K and V) as the runner allocates it."""
    if isinstance(dtype, KVQuant):
        return kv_quant.block_nbytes(spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim)
    element = torch.empty((), dtype=dtype).element_size()
    return block_size * spec.kv_bytes_per_token(element)
