"""Reading a GGUF file's header: its architecture and where each tensor's bytes lie.

``gguf.GGUFReader`` builds a numpy view of every metadata value first, the ~98k
tokenizer strings of the default model included: 10-30 s on a loaded 2-core machine, at
every start. The tensors need none of that: this reader walks the metadata, skipping
values by their sizes, and keeps only the architecture, the alignment and the tensor
table (GGUF v2/v3: little-endian; u64 counts and string lengths). The tensor bytes stay
in a read-only memory map.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    ggml_type: int
    offset: int  # absolute, in the file


@dataclass(frozen=True, slots=True)
class GGUFFile:
    architecture: str | None
    tensors: dict[str, TensorInfo]
    data: np.memmap  # the whole file, uint8

    def tensor_bytes(self, name: str, nbytes: int) -> np.ndarray:
        offset = self.tensors[name].offset
        if offset + nbytes > len(self.data):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        return self.data[offset : offset + nbytes]


class _Cursor:
    def __init__(self, raw: memoryview) -> None:
        self.raw, self.pos = raw, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.raw, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        self.pos += n
        return bytes(self.raw[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip(self, vtype: int) -> None:
        if vtype == _STRING:
            (n,) = self.unpack("<Q")
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[etype]
            else:
                for _ in range(count):
                    self.skip(etype)
        elif vtype in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[vtype]
        else:
            raise GGUFFormatError(f"unknown metadata value type {vtype}")


def read_gguf(path: Path) -> GGUFFile:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    try:
        magic, version, n_tensors, n_kv = cur.unpack("<4sIQQ")
        if magic != _MAGIC or version < 2:
            raise GGUFFormatError(f"{path} is not a GGUF v2+ file")
        arch, alignment = None, 32
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("<I")
            if key == "general.architecture" and vtype == _STRING:
                arch = cur.string()
            elif key == "general.alignment" and vtype == 4:
                (alignment,) = cur.unpack("<I")
            else:
                cur.skip(vtype)
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("<I")
            shape = cur.unpack(f"<{n_dims}Q")
            ggml_type, offset = cur.unpack("<IQ")
            table.append((name, shape, ggml_type, offset))
    except struct.error as e:
        raise GGUFFormatError(f"{path}: truncated header ({e})") from None
    start = -(-cur.pos // alignment) * alignment
    tensors = {name: TensorInfo(tuple(shape), t, start + off) for name, shape, t, off in table}
    return GGUFFile(arch, tensors, data)
