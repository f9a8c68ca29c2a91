"""Reading a weight set from its source checkpoint, in pieces of bounded size, with progress.

Role: sources are a safetensors file, an HF directory of *.safetensors (sharded or not; headers
through memory/safetensors_io.py), or a torch checkpoint file. `source_pieces` yields the set's
bytes in its flat layout (memory/layout.py), tensor by tensor in layout order, each tensor cut
into pieces of at most `piece_bytes`: a safetensors tensor is read with plain `pread`s (no
memory map, so no page of the checkpoint is counted in the process's memory) and, where the
layout's dtype differs from the file's (a bf16 checkpoint for a float32 teacher), cast piece by
piece. `read_source` fills a flat buffer from them (the host tier); `NvmeStore.write_stream`
writes them to the NVMe tier with no copy of the whole set anywhere. Progress goes to a callback
(bytes done, bytes total), which callers turn into a progress bar or log lines.

A set sharded by rows (a teacher split over tensor-parallel ranks, training/teacher_weights.py)
names its source `<checkpoint>::rows=<r>/<n>` (`sharded_source`): each tensor whose layout shape
has 1/n of the checkpoint's rows (dim 0) is read as its r-th block of rows, one contiguous byte
range of the file; a tensor of the checkpoint's own shape is read whole. The NVMe tier keeps the
same source string, so a repair reads the same rows again.

Invariant: for safetensors, the host memory used beyond the destination is two buffers of
`piece_bytes` (the read and its cast), whatever the size of the checkpoint or of its largest
tensor; a torch checkpoint file is loaded whole (torch.load has no partial read). Every name of
the layout must be in the checkpoint with the layout's shape (extra names are ignored), and the
dtypes must match or both be floating point: otherwise ValueError naming the source and the
tensor, before any byte is yielded. Bytes between tensors (alignment) are zero in the buffer
`read_source` fills, so a set read twice from its source is the same bytes (NVMe checksums).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from memory.layout import FlatLayout, TensorSpec, bind, is_torch_checkpoint
from memory.safetensors_io import TensorExtent, tensor_extents

DEFAULT_PIECE_BYTES = 16 << 20


def read_source(source: str, buffer: torch.Tensor, layout: FlatLayout,
                progress: Callable[[int, int], None] | None = None,
                piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
    """Fill `buffer` (1-D uint8, CPU) with the set in `layout` from its checkpoint."""
    bind(buffer, layout)  # checks the buffer's size and type
    zero_gaps(buffer, layout)
    for offset, piece in source_pieces(source, layout, piece_bytes, progress):
        buffer[offset:offset + piece.numel()].copy_(piece)


ROWS_MARK = "::rows="


def sharded_source(checkpoint: str, rank: int, world: int) -> str:
    """The source of rank `rank`'s row shard (of `world`) of `checkpoint`."""
    return f"{checkpoint}{ROWS_MARK}{rank}/{world}"


def split_source(source: str) -> tuple[str, tuple[int, int] | None]:
    """(checkpoint path, (rank, world) of a row shard, or None)."""
    path, mark, rows = source.rpartition(ROWS_MARK)
    if not mark:
        return source, None
    try:
        rank, world = (int(x) for x in rows.split("/"))
    except ValueError:
        raise ValueError(f"source {source!r}: expected {ROWS_MARK}<rank>/<world>") from None
    if not 0 <= rank < world:
        raise ValueError(f"source {source!r}: rank {rank} is not in 0..{world - 1}")
    return path, (rank, world)


def source_pieces(source: str, layout: FlatLayout, piece_bytes: int = DEFAULT_PIECE_BYTES,
                  progress: Callable[[int, int], None] | None = None
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    """(byte offset in the flat buffer, uint8 CPU tensor of the bytes there) for every tensor of
    `layout`, in increasing offset; each piece is at most `piece_bytes` and is overwritten by
    the next one (copy it before asking for more)."""
    if not source:
        raise ValueError("this weight set has no source checkpoint to load from")
    if piece_bytes < 16:
        raise ValueError(f"piece_bytes = {piece_bytes}: too small")
    source, rows = split_source(source)
    path = Path(source)
    if not path.exists():
        raise ValueError(f"no checkpoint at {path}")
    specs = sorted(layout.specs, key=lambda s: s.offset)
    done = 0
    if is_torch_checkpoint(path):
        pieces = _torch_pieces(path, specs, piece_bytes, rows)
    else:
        pieces = _safetensors_pieces(path, specs, piece_bytes, rows)
    for offset, piece in pieces:
        yield offset, piece
        done += piece.numel()
        if progress is not None:
            progress(done, layout.total_bytes)


def zero_gaps(buffer: torch.Tensor, layout: FlatLayout) -> None:
    """Zero the bytes of `buffer` that no tensor of the layout covers (alignment, page tail)."""
    end = 0
    for s in sorted(layout.specs, key=lambda s: s.offset):
        if s.offset > end:
            buffer[end:s.offset].zero_()
        end = max(end, s.offset + s.nbytes)
    buffer[end:layout.total_bytes].zero_()


def _row_block(spec: TensorSpec, ext: TensorExtent, rows: tuple[int, int] | None
               ) -> tuple[int, int]:
    """(first byte within the tensor, bytes) of what the layout holds of it: all of it, or
    the row shard's block of rows."""
    if rows is None or tuple(ext.shape) == tuple(spec.shape):
        return 0, ext.nbytes
    rank, world = rows
    return rank * (ext.nbytes // world), ext.nbytes // world


def _safetensors_pieces(path: Path, specs: list[TensorSpec], piece_bytes: int,
                        rows: tuple[int, int] | None = None
                        ) -> Iterator[tuple[int, torch.Tensor]]:
    extents = tensor_extents(path)
    for spec in specs:  # everything checked before the first byte is read
        _check(path, spec, extents.get(spec.name), rows)
    raw = torch.empty(piece_bytes, dtype=torch.uint8)
    cast = None
    files: dict[Path, int] = {}
    try:
        for spec in specs:
            ext = extents[spec.name]
            src_size = ext.dtype.itemsize
            dst_size = spec.torch_dtype.itemsize
            per_piece = piece_bytes // max(src_size, dst_size)
            skip, nbytes = _row_block(spec, ext, rows)
            count = nbytes // src_size
            if ext.file not in files:
                files[ext.file] = os.open(ext.file, os.O_RDONLY)
            for first in range(0, count, per_piece):
                n = min(per_piece, count - first)
                got = raw[:n * src_size]
                _pread_exactly(files[ext.file], got, ext.offset + skip + first * src_size, ext,
                               spec)
                if ext.dtype != spec.torch_dtype:
                    if cast is None:
                        cast = torch.empty(piece_bytes, dtype=torch.uint8)
                    out = cast[:n * dst_size]
                    out.view(spec.torch_dtype).copy_(got.view(ext.dtype))
                    got = out
                yield spec.offset + first * dst_size, got
    finally:
        for fd in files.values():
            os.close(fd)


def _torch_pieces(path: Path, specs: list[TensorSpec], piece_bytes: int,
                  rows: tuple[int, int] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    for spec in specs:
        t = state.get(spec.name)
        _check(path, spec, None if t is None else TensorExtent(
            path, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size()), rows)
    for spec in specs:
        t = state[spec.name]
        if rows is not None and tuple(t.shape) != tuple(spec.shape):
            t = t.chunk(rows[1])[rows[0]]
        data = t.to(spec.torch_dtype).contiguous().reshape(-1).view(torch.uint8)
        for first in range(0, data.numel(), piece_bytes):
            yield spec.offset + first, data[first:first + piece_bytes]


def _check(path: Path, spec: TensorSpec, ext: TensorExtent | None,
           rows: tuple[int, int] | None = None) -> None:
    if ext is None:
        raise ValueError(f"checkpoint {path} has no tensor {spec.name!r}")
    cast_ok = ext.dtype.is_floating_point and spec.torch_dtype.is_floating_point
    shape, want = tuple(ext.shape), tuple(spec.shape)
    row_shard = (rows is not None and len(shape) == len(want) >= 1 and shape[1:] == want[1:]
                 and want[0] * rows[1] == shape[0])
    if (shape != want and not row_shard) or (ext.dtype != spec.torch_dtype and not cast_ok):
        raise ValueError(f"{path}: {spec.name} is {ext.dtype} {tuple(ext.shape)}, the layout "
                         f"says {spec.torch_dtype} {tuple(spec.shape)}")


def _pread_exactly(fd: int, out: torch.Tensor, offset: int, ext: TensorExtent,
                   spec: TensorSpec) -> None:
    view = memoryview(out.numpy()).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"{ext.file} ends inside {spec.name} (at byte {offset + got})")
        got += n
