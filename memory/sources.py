"""Loading a weight set from its source checkpoint into a flat buffer, with progress.

Sources: a safetensors file, an HF directory of *.safetensors (sharded or not; read through
memory/safetensors_io.py), or a torch checkpoint file. Each tensor is copied into its place in
the buffer (the buffer's layout must be the checkpoint's, as `FlatLayout.from_checkpoint` builds
it). Progress goes to a callback (bytes done, bytes total),
which the prefetcher turns into a progress bar or log lines.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from memory.layout import FlatLayout, bind, is_torch_checkpoint
from memory.safetensors_io import iter_safetensors


def read_source(source: str, buffer: torch.Tensor, layout: FlatLayout,
                progress: Callable[[int, int], None] | None = None) -> None:
    if not source:
        raise ValueError("this weight set has no source checkpoint to load from")
    path = Path(source)
    views = bind(buffer, layout)
    done = 0
    for name, tensor in _iter_checkpoint(path):
        if name not in views:
            continue
        view = views[name]
        if view.dtype != tensor.dtype or tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(f"{source}: {name} is {tensor.dtype} {tuple(tensor.shape)}, the layout "
                             f"says {view.dtype} {tuple(view.shape)}")
        view.copy_(tensor)
        done += view.numel() * view.element_size()
        if progress is not None:
            progress(done, layout.total_bytes)


def _iter_checkpoint(path: Path):
    if is_torch_checkpoint(path):
        yield from torch.load(path, map_location="cpu", weights_only=True).items()
    else:
        yield from iter_safetensors(path)
