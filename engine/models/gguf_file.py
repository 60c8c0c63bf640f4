"""A small, fast GGUF reader: header, metadata and tensor views over one memory map.

`gguf.GGUFReader` builds a numpy view per string (about 2 s for a 49k-token vocabulary);
this reads strings with `struct` and exposes tensors as plain ndarrays over the map, in the
byte layout `gguf.quants.dequantize` expects. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value type -> (struct format, numpy dtype) of the scalar types.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


class GGUFFormatError(ValueError):
    """The file is not a (little-endian, version 2/3) GGUF file or is truncated."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # raw: uint8 [..., bytes_per_row] for quantized types, else typed


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("truncated file")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFFormatError("truncated string")
        text = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type][0])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        raise GGUFFormatError(f"unknown metadata value type {value_type}")

    def array(self) -> list[Any]:
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        if item_type in _SCALARS:
            dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise GGUFFormatError("truncated array")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos = end
            return values
        return [self.value(item_type) for _ in range(count)]


class GGUFFile:
    """Metadata (key -> Python value) and tensors (name -> GGUFTensor) of a GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(memoryview(self._map))
        if bytes(cursor.buf[:4]) != _MAGIC:
            raise GGUFFormatError("bad magic (not a GGUF file)")
        cursor.pos = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version} (big-endian files are not supported)")
        num_tensors, num_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.unpack("<I"))
        infos = [self._tensor_info(cursor) for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors = {info[0]: self._tensor(cursor.buf, data_start, *info) for info in infos}

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string()
        num_dims = cursor.unpack("<I")
        dims = [cursor.unpack("<Q") for _ in range(num_dims)]
        return name, tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q")

    def _tensor(
        self, buf: memoryview, data_start: int, name: str, shape, type_id: int, offset: int
    ) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(type_id)
        except ValueError as exc:
            raise GGUFFormatError(f"tensor {name!r} has unknown type id {type_id}") from exc
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        num_elements = int(np.prod(shape)) if shape else 1
        if shape and shape[-1] % block_size:
            raise GGUFFormatError(
                f"tensor {name!r}: row length {shape[-1]} is not a multiple of {block_size}"
            )
        num_bytes = num_elements // block_size * type_size
        start = data_start + offset
        if start + num_bytes > len(buf):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        raw = np.frombuffer(buf, dtype=np.uint8, count=num_bytes, offset=start)
        if tensor_type in _TYPED:  # F32/F16: a typed view in the torch-order shape
            data = raw.view(_TYPED[tensor_type]).reshape(shape)
        else:  # bytes per row, as gguf.quants.dequantize expects
            data = raw.reshape(quant_shape_to_byte_shape(shape, tensor_type))
        return GGUFTensor(name, tuple(shape), tensor_type, data)
