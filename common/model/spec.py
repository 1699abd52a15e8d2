"""Which architectures Tandem runs, read from a Hugging Face ``config.json``.

``ModelSpec.from_hf_config`` is the one place that accepts or refuses a model: anything
outside the Llama family (Llama 1-3, SmolLM2, TinyLlama, Mistral without a sliding
window, Qwen2) gets an ``UnsupportedModelError`` that says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.kv_size * element_size

    def num_params(self, with_embeddings: bool = True) -> int:
        per_layer = (self.hidden_size * (self.q_size + 2 * self.kv_size)
                     + self.q_size * self.hidden_size
                     + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size)
        body = self.num_layers * per_layer + self.hidden_size
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return body + (emb if with_embeddings else 0)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelSpec:
        try:
            return cls._from_hf_config(cfg)
        except (KeyError, TypeError) as e:
            raise UnsupportedModelError(f"config.json is incomplete or malformed: {e!r}") from e

    @classmethod
    def _from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelSpec:
        arch = _architecture(cfg)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"activation {act!r} is not supported (only silu)")
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _rope(cfg)
        family = SUPPORTED_ARCHITECTURES[arch]
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias and family != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=_sliding_window(cfg, family),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        )


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    if not archs and cfg.get("model_type") in by_type:
        return by_type[cfg["model_type"]]
    name = ", ".join(archs) or cfg.get("model_type") or "unknown"
    raise UnsupportedModelError(
        f"unsupported architecture {name}: Tandem runs {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(cfg: Mapping[str, Any]) -> tuple[float, Mapping[str, Any] | None]:
    # transformers 5 nests rope settings in rope_parameters; older configs use rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise UnsupportedModelError(f"RoPE scaling {rope_type!r} is not supported (default, linear, llama3)")
    scaling["rope_type"] = rope_type
    return theta, scaling


def _sliding_window(cfg: Mapping[str, Any], family: str) -> int | None:
    window = cfg.get("sliding_window")
    if family == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
