"""Our GGUF header reader (``common/model/gguf_file.py``) against gguf's own reader: the
same architecture, tensor table and bytes; a file cut short is a clear error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from common.model.gguf_file import GGUFFormatError, read_gguf
from tests.tiny_gguf import write_tiny_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-file") / "t.gguf", Q.Q4_1,
                           overrides={"blk.1.ffn_down": Q.F16})


def test_the_tensor_table_and_bytes_equal_ggufs_own_reader(tiny):
    ours, theirs = read_gguf(tiny), gguf.GGUFReader(str(tiny))
    assert ours.architecture == theirs.fields["general.architecture"].contents() == "llama"
    assert sorted(ours.tensors) == sorted(t.name for t in theirs.tensors)
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert (info.shape, info.ggml_type) == (tuple(int(d) for d in t.shape), int(t.tensor_type))
        raw = ours.tensor_bytes(t.name, int(t.n_bytes))
        assert np.array_equal(raw, np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


def test_a_truncated_file_is_a_clear_error(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:200])
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + tiny.read_bytes()[4:])
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        read_gguf(bad)
