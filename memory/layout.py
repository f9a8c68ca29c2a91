"""Flat layouts: a weight set as one contiguous byte buffer with a fixed name -> tensor map.

A `FlatLayout` lists every tensor of a model (name, dtype, shape, byte offset) at offsets aligned
to `ALIGN_BYTES`, and a total size rounded up to `PAGE_BYTES`, so that every tier stores the set as
one buffer, every move between tiers is one large sequential copy, and an NVMe file in this
layout can be read with O_DIRECT straight into a page-aligned buffer.

Invariant: a layout is immutable and fully described by its JSON form; two buffers in the same
layout hold the same tensor at the same offset, so moving a set is a byte copy and `bind` gives
named tensors that view a buffer without copying.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from memory.safetensors_io import safetensors_shapes
from transport.dtypes import dtype_name, torch_dtype

ALIGN_BYTES = 256  # every tensor starts at a multiple of this (cache lines, GPU vector loads)
PAGE_BYTES = 4096  # buffers and files are whole pages (O_DIRECT needs aligned lengths)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the flat buffer

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class FlatLayout:
    specs: tuple[TensorSpec, ...]
    total_bytes: int  # buffer size: the end of the last tensor rounded up to PAGE_BYTES

    @classmethod
    def from_shapes(cls, shapes: Iterable[tuple[str, torch.dtype | str, tuple[int, ...]]]
                    ) -> FlatLayout:
        specs, offset = [], 0
        for name, dtype, shape in shapes:
            dtype = dtype_name(torch_dtype(dtype))
            spec = TensorSpec(name, dtype, tuple(int(s) for s in shape), offset)
            specs.append(spec)
            offset = _round_up(offset + spec.nbytes, ALIGN_BYTES)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in a weight set: "
                             f"{sorted({n for n in names if names.count(n) > 1})}")
        return cls(tuple(specs), _round_up(max(offset, 1), PAGE_BYTES))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> FlatLayout:
        return cls.from_shapes((n, t.dtype, tuple(t.shape)) for n, t in state.items())

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> FlatLayout:
        """Parameters and persistent buffers, tied weights once (under their first name)."""
        return cls.from_state_dict(module_tensors(module))

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> FlatLayout:
        """From safetensors headers (a file or an HF directory, sharded or not; no tensor is read)
        or a torch checkpoint file (read on the CPU)."""
        return cls.from_shapes(checkpoint_shapes(Path(path)))

    def __getitem__(self, name: str) -> TensorSpec:
        return self._by_name[name]

    @property
    def _by_name(self) -> dict[str, TensorSpec]:
        cache = self.__dict__.get("_index")
        if cache is None:
            cache = {s.name: s for s in self.specs}
            object.__setattr__(self, "_index", cache)
        return cache

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def fingerprint(self) -> str:
        """Identifies the layout (names, dtypes, shapes, offsets): two sets with the same
        fingerprint can be copied into each other byte for byte."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps({"total_bytes": self.total_bytes,
                           "specs": [[s.name, s.dtype, list(s.shape), s.offset]
                                     for s in self.specs]})

    @classmethod
    def from_json(cls, text: str) -> FlatLayout:
        d = json.loads(text)
        specs = tuple(TensorSpec(n, dt, tuple(sh), off) for n, dt, sh, off in d["specs"])
        return cls(specs, int(d["total_bytes"]))

    def chunks(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """(offset, length) pieces covering the buffer; lengths are whole pages."""
        if chunk_bytes <= 0 or chunk_bytes % PAGE_BYTES:
            raise ValueError(f"chunk_bytes = {chunk_bytes}: use a positive multiple of "
                             f"{PAGE_BYTES}")
        return [(o, min(chunk_bytes, self.total_bytes - o))
                for o in range(0, self.total_bytes, chunk_bytes)]


def bind(buffer: torch.Tensor, layout: FlatLayout) -> dict[str, torch.Tensor]:
    """Named tensors that view `buffer` (1-D uint8, at least `total_bytes` long): no copy."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("bind needs a 1-D uint8 buffer")
    if buffer.numel() < layout.total_bytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes is smaller than the layout "
                         f"({layout.total_bytes} bytes)")
    return {s.name: buffer[s.offset:s.offset + s.nbytes].view(s.torch_dtype).view(s.shape)
            for s in layout.specs}


@torch.no_grad()
def pack(tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor, layout: FlatLayout) -> None:
    """Copy named tensors into their places in `buffer` (any device; dtypes must match)."""
    views = bind(buffer, layout)
    missing = set(views) - set(tensors)
    if missing:
        raise ValueError(f"tensors missing for the layout: {sorted(missing)[:5]}")
    for name, view in views.items():
        src = tensors[name]
        if src.dtype != view.dtype or tuple(src.shape) != tuple(view.shape):
            raise ValueError(f"{name}: got {src.dtype} {tuple(src.shape)}, layout says "
                             f"{view.dtype} {tuple(view.shape)}")
        view.copy_(src, non_blocking=True)


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (the registered objects themselves, so that
    `.data` can be re-pointed), each storage once (tied weights share)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        key = t.data_ptr() if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def checkpoint_shapes(path: Path) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Safetensors (a file or an HF directory, sharded or not: headers only) or a torch
    checkpoint file (read on the CPU)."""
    if is_torch_checkpoint(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        return [(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    return safetensors_shapes(path)


def is_torch_checkpoint(path: Path) -> bool:
    """A file that is not safetensors: a torch.save'd {name: tensor}."""
    return path.is_file() and path.suffix != ".safetensors"


def _round_up(n: int, quantum: int) -> int:
    return (n + quantum - 1) // quantum * quantum
