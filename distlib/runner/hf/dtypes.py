"""The dtype names of the formats the runner reads and writes, in one place: safetensors headers,
the storage classes a ``torch.save`` pickle names, and the short names a command line takes."""

from __future__ import annotations

import torch

# the safetensors dtypes read (and written), those this torch has
SAFETENSORS: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.items() if hasattr(torch, v)}  # fmt: skip
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS.items()}

# the storage classes a torch.save pickle names, and their dtypes (the classes' own dtype
# attribute warns that typed storages are deprecated)
TORCH_STORAGES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool}  # fmt: skip

# the floating dtypes a command line names (export's --dtype)
SHORT: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

__all__ = ["SAFETENSORS", "SAFETENSORS_NAMES", "SHORT", "TORCH_STORAGES"]
