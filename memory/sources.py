"""Loading a weight set from its source checkpoint into a flat buffer, with progress.

Sources: a safetensors file, an HF directory of *.safetensors, or a torch checkpoint file. Each
tensor is copied into its place in the buffer (the buffer's layout must be the checkpoint's, as
`FlatLayout.from_checkpoint` builds it). Progress goes to a callback (bytes done, bytes total),
which the prefetcher turns into a progress bar or log lines.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from memory.layout import FlatLayout, bind


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
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        raise ValueError(f"no checkpoint at {path}")
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        else:
            yield from torch.load(f, map_location="cpu", weights_only=True).items()
