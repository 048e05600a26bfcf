"""The tensors of a GGUF file, and its metadata's scalars and strings, without its arrays:
gguf-py's reader decodes every key/value (the tokenizer's 49k strings, merges) element by
element, 7.6 s for the embedded model, and this needs only where each tensor's blocks lie and a
few numbers. Layout per the GGUF spec (version 2 and 3): header, key/values, tensor infos, then
the data, aligned."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
# Value types of fixed size -> their struct format (u8, i8, u16, i16, u32, i32, f32, bool, u64,
# i64, f64); 8 is a string, 9 an array.
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
SCALAR_BYTES = {value_type: struct.calcsize(fmt) for value_type, fmt in SCALAR_FORMATS.items()}
STRING, ARRAY = 8, 9
Scalar = int | float | bool | str
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str  # GGML's: Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # PyTorch order: [rows, row length]
    data: np.ndarray  # uint8 [rows, bytes per row], a view of the mapped file


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        self.offset += length
        return bytes(self.buffer[self.offset - length : self.offset]).decode()

    def skip_value(self, value_type: int) -> None:
        if value_type in SCALAR_BYTES:
            self.offset += SCALAR_BYTES[value_type]
        elif value_type == STRING:
            (length,) = self.unpack("Q")
            self.offset += length
        elif value_type == ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type in SCALAR_BYTES:
                self.offset += count * SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            raise ValueError(f"model: GGUF value type {value_type} unknown")


def _metadata(mapped: np.memmap, path: Path) -> tuple[_Cursor, int, dict[str, Scalar]]:
    """The cursor past the key/values, the number of tensors, and the scalar and string values."""
    cursor = _Cursor(memoryview(mapped))
    magic = bytes(mapped[:4])
    cursor.offset = 4
    (version,) = cursor.unpack("I")
    if magic != MAGIC or version not in (2, 3):
        raise ValueError(f"model: {path} is not a GGUF file of version 2 or 3")
    num_tensors, num_values = cursor.unpack("QQ")
    values: dict[str, Scalar] = {}
    for _ in range(num_values):
        key = cursor.string()
        (value_type,) = cursor.unpack("I")
        if value_type in SCALAR_FORMATS:
            (values[key],) = cursor.unpack(SCALAR_FORMATS[value_type])
        elif value_type == STRING:
            values[key] = cursor.string()
        else:
            cursor.skip_value(value_type)
    return cursor, num_tensors, values


def read_metadata(path: Path) -> dict[str, Scalar]:
    """The file's key/values but its arrays (the tokenizer's): `general.architecture`, shapes."""
    return _metadata(np.memmap(path, dtype=np.uint8, mode="r"), path)[2]


def read_tensors(path: Path) -> dict[str, GgufTensor]:
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor, num_tensors, values = _metadata(mapped, path)
    alignment = int(values.get("general.alignment", DEFAULT_ALIGNMENT))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        (num_dims,) = cursor.unpack("I")
        dims = cursor.unpack("Q" * num_dims)  # GGML order: the row length first
        type_id, offset = cursor.unpack("IQ")
        infos.append((name, GGMLQuantizationType(type_id), dims, offset))
    start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, qtype, dims, offset in infos:
        per_block, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // per_block * block_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        data = mapped[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GgufTensor(name, qtype.name, (rows, dims[0]), data)
    return tensors
