"""The engine's Triton attention wiring, run for real: ``TritonBackend`` (what
``select_backend`` picks on CUDA) drives whole engine steps — batched prefill, a chunked
prefill over cached context, decodes — on the GPU when there is one, else under
``TRITON_INTERPRET=1`` (tests/conftest.py), and gives what the torch reference path gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.sampling_params import SamplingParams
from kernels.attention import TorchBackend, TritonBackend
from tests.conftest import loaded_model, make_engine

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)


def run(model_dir, backend, kv_cache_dtype: str = "auto") -> list:
    loaded = dataclasses.replace(loaded_model(model_dir), backend=backend)
    # A budget of 8 tokens: the 21-token prompt prefills in chunks over cached context,
    # while the 3-token one is already decoding in the same steps.
    engine = make_engine(model_dir, max_num_batched_tokens=8, loaded=loaded,
                         kv_cache_dtype=kv_cache_dtype)
    assert engine.loaded.backend is backend
    return engine.generate([[5, 6, 7], list(range(40, 61))], GREEDY)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_engine_through_the_triton_backend_matches_the_torch_path(tiny_model_dir, kv_cache_dtype):
    got = run(tiny_model_dir, TritonBackend(), kv_cache_dtype)
    want = run(tiny_model_dir, TorchBackend(use_c_kernel=False), kv_cache_dtype)
    for g, w in zip(got, want, strict=True):
        [gc], [wc] = g.choices, w.choices
        assert gc.token_ids == wc.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in gc.logprobs]),
                                   torch.tensor([lp.logprob for lp in wc.logprobs]),
                                   atol=1e-4, rtol=0)
