"""Dtype names <-> torch dtypes: the one place that turns a dtype's name into a torch dtype and back.

Role: every dtype that is written down (a config's `dtype = "bfloat16"`, a tensor reference on the
wire, a flat layout's JSON, the `dtypes` of SGLang's /update_weights_from_distributed, a
safetensors header's "BF16") is read and written through these functions. Names are torch's own
without the "torch." prefix ("bfloat16", "float32", "int64"); "torch.bfloat16" is accepted too.
Invariant: an unknown name raises ValueError naming the allowed ones; `dtype_name` and
`torch_dtype` are inverse on every torch dtype of non-zero size.
torch is imported on first use, not with this module: the wire's names, item sizes and numpy
dtypes (`WIRE_ITEMSIZE`, `NUMPY_DTYPES`) are plain tables, so an actor that only moves numpy
arrays (the buffer, the router) never pays for importing torch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

MODEL_DTYPES = ("float32", "bfloat16", "float16")

# Item sizes of the wire's common dtype names, without torch (a test checks them against torch);
# other torch dtypes are looked up in torch itself (`wire_itemsize`).
NUMPY_DTYPES: dict[str, np.dtype] = {n: np.dtype(n) for n in (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "complex64", "complex128")}
WIRE_ITEMSIZE: dict[str, int] = {
    **{n: d.itemsize for n, d in NUMPY_DTYPES.items()}, "bfloat16": 2, "complex32": 4,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1}


@functools.cache
def _tables() -> tuple[dict[str, torch.dtype], dict[str, torch.dtype]]:
    import torch

    # every torch dtype with a size, by canonical name (aliases such as "half" or "long" are not
    # names)
    names = dict(sorted((str(d).removeprefix("torch."), d) for d in vars(torch).values()
                        if isinstance(d, torch.dtype) and d.itemsize > 0))
    # safetensors header codes (the format's spec; safetensors.torch reads the same)
    codes = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
        "BOOL": torch.bool, "C64": torch.complex64,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
        "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz}
    return names, codes


def __getattr__(name: str) -> Any:  # TORCH_DTYPES and SAFETENSORS_DTYPES, built on first use
    if name == "TORCH_DTYPES":
        return _tables()[0]
    if name == "SAFETENSORS_DTYPES":
        return _tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wire_itemsize(name: str) -> int | None:
    """Bytes per element of the dtype named `name` (None for a name torch does not have)."""
    size = WIRE_ITEMSIZE.get(name)
    if size is None and isinstance(name, str):
        dtype = _tables()[0].get(name)
        size = dtype.itemsize if dtype is not None else None
    return size


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (what configs, the wire and SGLang's requests carry)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str | torch.dtype, allowed: Iterable[str] | None = None) -> torch.dtype:
    """"bfloat16" (or "torch.bfloat16", or a torch dtype) -> torch.bfloat16; ValueError naming the
    allowed names (`allowed`, default every torch dtype) for anything else."""
    import torch

    TORCH_DTYPES = _tables()[0]
    names = TORCH_DTYPES if allowed is None else {n: TORCH_DTYPES[n] for n in allowed}
    key = dtype_name(name) if isinstance(name, torch.dtype) else \
        name.removeprefix("torch.") if isinstance(name, str) else None
    if key not in names:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(names)}")
    return names[key]


def model_dtype(name: str | torch.dtype) -> torch.dtype:
    """A model's parameter dtype: "float32" | "bfloat16" | "float16"; ValueError otherwise."""
    return torch_dtype(name, MODEL_DTYPES)


def safetensors_dtype(code: str) -> torch.dtype:
    """A safetensors header's dtype code ("BF16", "F32", ...) -> torch dtype; ValueError otherwise."""
    SAFETENSORS_DTYPES = _tables()[1]
    if code not in SAFETENSORS_DTYPES:
        raise ValueError(f"unknown safetensors dtype {code!r}; expected one of "
                         f"{', '.join(SAFETENSORS_DTYPES)}")
    return SAFETENSORS_DTYPES[code]


def has_numpy(dtype: torch.dtype) -> bool:
    """Whether `tensor.numpy()` works for this dtype (numpy has no bfloat16 nor 8-bit floats)."""
    import torch

    return not (dtype == torch.bfloat16 or dtype.is_floating_point and dtype.itemsize == 1)
