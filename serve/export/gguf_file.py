"""GGUF files as the llama.cpp exports read and write them: typed metadata in, torch tensors out.

Metadata values keep their GGUF types (llama.cpp reads `eagle3.target_layers` as int32s and the sizes as uint32s);
`gguf_value` types a plain Python value the way llama.cpp's converter does. Tensors are written as llama.cpp's
converter writes them: matrices in the export dtype, vectors (norms) rounded to it but stored as float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from torch import Tensor

# the export dtypes (dtype=fp32 | fp16 | bf16) as GGML tensor types
GGML_TYPES = {
    torch.float32: GGMLQuantizationType.F32,
    torch.float16: GGMLQuantizationType.F16,
    torch.bfloat16: GGMLQuantizationType.BF16,
}
PLAIN = {  # GGML tensor types numpy holds as they are
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.I64: np.int64,
    GGMLQuantizationType.I32: np.int32,
}
FILE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}  # general.file_type (llama_ftype)


def gguf_value(value: Any) -> gguf.GGUFValue:
    """A Python value with the GGUF type llama.cpp's converter gives it: bool, uint32 sizes, float32, strings,
    int32 arrays (layer ids)."""
    if isinstance(value, bool):
        return gguf.GGUFValue(value, GGUFValueType.BOOL)
    if isinstance(value, int):
        return gguf.GGUFValue(value, GGUFValueType.UINT32)
    if isinstance(value, float):
        return gguf.GGUFValue(value, GGUFValueType.FLOAT32)
    if isinstance(value, str):
        return gguf.GGUFValue(value, GGUFValueType.STRING)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return gguf.GGUFValue(list(value), GGUFValueType.ARRAY, GGUFValueType.INT32)
    raise TypeError(f"no GGUF type for {value!r}")


def ggml_array(t: Tensor, dtype: torch.dtype) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A tensor as written: integer tables as int64, matrices in `dtype`, vectors (llama.cpp's norms) rounded to
    `dtype` but stored as float32, as llama.cpp's converter stores them."""
    if not t.is_floating_point():
        return t.to(torch.int64).contiguous().numpy(), GGMLQuantizationType.I64
    t = t.detach().to(dtype).float().contiguous()
    if t.dim() <= 1 or dtype == torch.float32:
        return t.numpy(), GGMLQuantizationType.F32
    if dtype == torch.float16:
        return t.half().numpy(), GGMLQuantizationType.F16
    return gguf.quants.quantize(t.numpy(), GGMLQuantizationType.BF16), GGMLQuantizationType.BF16


def write_gguf(
    path: Path, arch: str, metadata: dict[str, gguf.GGUFValue], tensors: dict[str, Tensor], dtype: torch.dtype
) -> None:
    """Write one GGUF file: general.architecture `arch`, the metadata in order, then the tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, v in metadata.items():
        writer.add_key_value(key, v.value, v.type, v.sub_type)
    for name, t in tensors.items():
        array, kind = ggml_array(t, dtype)
        writer.add_tensor(name, array, raw_dtype=kind if kind == GGMLQuantizationType.BF16 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_metadata(reader: gguf.GGUFReader, skip: tuple[str, ...] = ("GGUF.",)) -> dict[str, gguf.GGUFValue]:
    """Every key-value pair of a GGUF file but its header fields, with its GGUF types."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith(skip):
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1 else None
        out[key] = gguf.GGUFValue(field.contents(), field.types[0], sub)
    return out


def as_torch(t: gguf.ReaderTensor) -> Tensor:
    """A tensor of a GGUF file in torch, in PyTorch's dimension order (llama.cpp's ne reversed); quantized types
    (a Q4_1 target's) dequantized to float32."""
    shape = tuple(int(n) for n in reversed(t.shape))
    kind = t.tensor_type
    if kind == GGMLQuantizationType.BF16:  # numpy has no bfloat16: its bits, viewed by torch
        return torch.from_numpy(np.array(t.data).view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
    if kind in PLAIN:
        return torch.from_numpy(np.array(t.data, dtype=PLAIN[kind])).reshape(shape)
    return torch.from_numpy(gguf.quants.dequantize(t.data, kind).astype(np.float32)).reshape(shape)


def read_gguf(path: Path, names: tuple[str, ...] | None = None) -> tuple[dict[str, gguf.GGUFValue], dict[str, Tensor]]:
    """A GGUF file's metadata and tensors (only `names`, when given); ValueError when it does not parse."""
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, AssertionError) as e:  # what a truncated or foreign file raises
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    tensors = {t.name: as_torch(t) for t in reader.tensors if names is None or t.name in names}
    return read_metadata(reader), tensors


def plain(metadata: dict[str, gguf.GGUFValue]) -> dict[str, Any]:
    return {k: v.value for k, v in metadata.items()}
