"""transport/dtypes.py: dtype names <-> torch dtypes, safetensors codes, numpy support."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save

from transport.dtypes import (
    MODEL_DTYPES,
    NUMPY_DTYPES,
    SAFETENSORS_DTYPES,
    TORCH_DTYPES,
    dtype_name,
    has_numpy,
    model_dtype,
    safetensors_dtype,
    torch_dtype,
    wire_itemsize,
)


def test_names_and_torch_dtypes_round_trip():
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("torch.float16") is torch.float16  # SGLang sends str(dtype)
    assert torch_dtype(torch.int64) is torch.int64
    assert dtype_name(torch.bfloat16) == "bfloat16"
    for name, dtype in TORCH_DTYPES.items():
        assert dtype_name(dtype) == name and torch_dtype(name) is dtype
    assert {"float32", "bfloat16", "float16", "int64", "uint8", "bool", "float8_e4m3fn"} <= set(
        TORCH_DTYPES)


@pytest.mark.parametrize("bad", ["bf16", "half", "float", "Tensor", "", None, 3])
def test_unknown_names_are_refused_naming_the_allowed_ones(bad):
    with pytest.raises(ValueError, match=r"unknown dtype .*expected one of .*bfloat16"):
        torch_dtype(bad)


def test_model_dtypes_are_the_three_parameter_dtypes():
    assert [model_dtype(n) for n in MODEL_DTYPES] == [torch.float32, torch.bfloat16,
                                                      torch.float16]
    with pytest.raises(ValueError, match="expected one of float32, bfloat16, float16$"):
        model_dtype("int8")
    with pytest.raises(ValueError, match="expected one of float32, bfloat16, float16$"):
        model_dtype("fp32")


def test_safetensors_codes_match_the_files_safetensors_writes():
    for dtype in SAFETENSORS_DTYPES.values():
        blob = save({"t": torch.zeros(2, dtype=dtype)})
        header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
        assert safetensors_dtype(header["t"]["dtype"]) is dtype
    assert safetensors_dtype("BF16") is torch.bfloat16 and safetensors_dtype("F32") is torch.float32
    with pytest.raises(ValueError, match="unknown safetensors dtype 'bfloat16'.*BF16"):
        safetensors_dtype("bfloat16")


def test_numpy_support():
    assert has_numpy(torch.float32) and has_numpy(torch.int64) and has_numpy(torch.float16)
    assert not has_numpy(torch.bfloat16) and not has_numpy(torch.float8_e5m2)


def test_wire_tables_agree_with_torch_and_numpy():
    """The torch-free tables the codec reads agree with torch's dtypes and numpy's."""
    for name, dtype in TORCH_DTYPES.items():
        assert wire_itemsize(name) == dtype.itemsize, name
    for name, np_dtype in NUMPY_DTYPES.items():
        assert has_numpy(TORCH_DTYPES[name])
        assert torch.zeros(2, dtype=TORCH_DTYPES[name]).numpy().dtype == np_dtype
    assert wire_itemsize("nosuch") is None


def test_light_actors_do_not_import_torch():
    """The buffer and the router (and every actor process's entry) move numpy arrays only, so
    they start without importing torch (~1-2 s and ~230 MB each)."""
    code = ("import sys, runtime.child, actors.buffer, actors.router, transport.rpc; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr
