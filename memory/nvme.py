"""The NVMe tier: weight sets as files in their flat layout, with a checksum per chunk.

`<root>/<tag>.bin` holds the flat buffer (whole pages), `<tag>.json` its manifest: layout,
chunk size, CRC-32 of every chunk, and the source checkpoint it came from (so a corrupted chunk
can be reloaded from there). A set is written from a flat buffer (`write`) or streamed from its
checkpoint piece by piece through one chunk-sized staging buffer (`write_stream`: a teacher
beyond the host budget goes from its checkpoint to this tier without a copy in host memory).
Written pages are dropped from the page cache after the sync. Reads use O_DIRECT (no page-cache
copy) into page-aligned buffers, with several chunk reads in flight on a thread pool (the
syscalls release the GIL); where O_DIRECT is refused (tmpfs, a misaligned buffer) the same code
reads buffered and says so.

Invariant: a manifest is written only after its data file is complete and synced, and removed
before a data file is replaced, so a reader never sees a half-written set: a missing manifest
means "not on NVMe". A full disk removes the partial file and raises with the numbers.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import shutil
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from memory.checksum import ChecksumError
from memory.layout import PAGE_BYTES, FlatLayout
from transport.errors import RlxError

DEFAULT_CHUNK_BYTES = 16 << 20


class DiskFullError(RlxError, OSError):
    pass


@dataclass(frozen=True)
class Manifest:
    layout: FlatLayout
    chunk_bytes: int
    checksums: tuple[int, ...]
    source: str  # checkpoint the set came from ("" = none): where a bad chunk is reloaded from

    def to_json(self) -> str:
        return json.dumps({"layout": self.layout.to_json(), "chunk_bytes": self.chunk_bytes,
                           "checksums": list(self.checksums), "source": self.source})

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        return cls(FlatLayout.from_json(d["layout"]), d["chunk_bytes"], tuple(d["checksums"]),
                   d["source"])


@dataclass
class ReadStats:
    nbytes: int = 0
    direct: bool = True  # False: O_DIRECT was refused and the read went through the page cache


class NvmeStore:
    """Files of flat weight sets under one directory."""

    def __init__(self, root: str | Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 num_readers: int = 4):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if chunk_bytes % PAGE_BYTES:
            raise ValueError(f"chunk_bytes = {chunk_bytes}: use a multiple of {PAGE_BYTES}")
        self.chunk_bytes, self.num_readers = chunk_bytes, num_readers

    def data_path(self, tag: str) -> Path:
        return self.root / f"{_safe(tag)}.bin"

    def manifest_path(self, tag: str) -> Path:
        return self.root / f"{_safe(tag)}.json"

    def has(self, tag: str) -> bool:
        return self.manifest_path(tag).exists()

    def manifest(self, tag: str) -> Manifest:
        if not self.has(tag):
            raise KeyError(f"weight set {tag!r} is not on NVMe under {self.root}")
        return Manifest.from_json(self.manifest_path(tag).read_text())

    # ---- write ---------------------------------------------------------------------------
    def write(self, tag: str, buffer: torch.Tensor, layout: FlatLayout, source: str = "") -> None:
        """Store a CPU flat buffer; on any failure nothing readable is left behind."""
        data = buffer[:layout.total_bytes]
        self._write_chunks(tag, layout, (data[off:off + n] for off, n in
                                         layout.chunks(self.chunk_bytes)), source)

    def write_stream(self, tag: str, layout: FlatLayout,
                     pieces: Iterable[tuple[int, torch.Tensor]], source: str = "",
                     progress: Callable[[int, int], None] | None = None) -> None:
        """Store a set given as pieces (byte offset in the flat buffer, uint8 CPU bytes), in
        increasing offset order (memory/sources.py `source_pieces`: a checkpoint streamed
        straight here). They are assembled chunk by chunk in one staging buffer of `chunk_bytes`,
        so the set never exists whole in memory; bytes no piece covers are zeros."""
        self._write_chunks(tag, layout, _assemble(layout, pieces, self.chunk_bytes), source,
                           progress)

    def drop_cache(self, tag: str) -> None:
        """Ask the kernel to drop the set's file from the page cache (clean pages only), so a
        read that cannot use O_DIRECT still comes from the disk."""
        fd = os.open(self.data_path(tag), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def _write_chunks(self, tag: str, layout: FlatLayout, chunks: Iterable[torch.Tensor],
                      source: str, progress: Callable[[int, int], None] | None = None) -> None:
        free = shutil.disk_usage(self.root).free
        if free < layout.total_bytes:
            raise DiskFullError(errno.ENOSPC, f"NVMe tier {self.root}: {tag!r} needs "
                                f"{layout.total_bytes / 2**20:.1f} MiB, "
                                f"{free / 2**20:.1f} MiB free")
        self.manifest_path(tag).unlink(missing_ok=True)  # the old set is gone from here on
        tmp = self.data_path(tag).with_suffix(".bin.tmp")
        sums, done = [], 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    piece = memoryview(chunk.numpy())
                    sums.append(zlib.crc32(piece))
                    f.write(piece)
                    done += len(piece)
                    if progress is not None:
                        progress(done, layout.total_bytes)
                f.flush()
                os.fsync(f.fileno())
                # written pages leave the page cache: later reads come from the disk
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise DiskFullError(errno.ENOSPC, f"NVMe tier {self.root} is full while writing "
                                    f"{tag!r}; the partial file was removed") from e
            raise
        tmp.replace(self.data_path(tag))
        man = Manifest(layout, self.chunk_bytes, tuple(sums), source)
        mtmp = self.manifest_path(tag).with_suffix(".json.tmp")
        mtmp.write_text(man.to_json())
        mtmp.replace(self.manifest_path(tag))

    # ---- read ----------------------------------------------------------------------------
    def read_into(self, tag: str, buffer: torch.Tensor, verify: bool = True,
                  on_chunk: Callable[[int, int], None] | None = None) -> ReadStats:
        """Read a set into a CPU uint8 buffer (page-aligned for O_DIRECT). `on_chunk(offset,
        nbytes)` runs as each chunk lands (in a reader thread), in no particular order, so a
        caller can start copying chunk i to the GPU while chunk i+1 is still being read.
        Raises ChecksumError naming the first bad chunk."""
        man = self.manifest(tag)
        total = man.layout.total_bytes
        if buffer.numel() < total:
            raise ValueError(f"buffer of {buffer.numel()} bytes cannot hold {tag!r} ({total})")
        fd, direct = _open_for_read(self.data_path(tag), buffer.data_ptr())
        stats = ReadStats(total, direct)
        data = buffer[:total].numpy()
        chunks = man.layout.chunks(man.chunk_bytes)

        def read_one(i: int) -> None:
            off, n = chunks[i]
            view = memoryview(data[off:off + n])
            got = 0
            while got < n:
                k = os.preadv(fd, [view[got:]], off + got)
                if k == 0:
                    raise ChecksumError(tag, off + got, n - got)  # truncated file
                got += k
            if verify and zlib.crc32(view) != man.checksums[i]:
                raise ChecksumError(tag, off, n)
            if on_chunk is not None:
                on_chunk(off, n)

        try:
            with concurrent.futures.ThreadPoolExecutor(self.num_readers) as pool:
                futures = [pool.submit(read_one, i) for i in range(len(chunks))]
                errors = [f.exception() for f in futures]
        finally:
            os.close(fd)
        bad = [e for e in errors if e is not None]
        if bad:
            raise min(bad, key=lambda e: getattr(e, "offset", 0))
        return stats


def _assemble(layout: FlatLayout, pieces: Iterable[tuple[int, torch.Tensor]], chunk_bytes: int
              ) -> Iterator[torch.Tensor]:
    """The chunks of `layout.chunks(chunk_bytes)` in order, filled from `pieces`, each yielded
    from one reused staging buffer (written out before the next one is assembled)."""
    chunks = layout.chunks(chunk_bytes)
    staging = torch.zeros(chunk_bytes, dtype=torch.uint8)
    index, end = 0, 0  # the chunk being assembled; the end of the last piece
    for offset, piece in pieces:
        if offset < end or offset + piece.numel() > layout.total_bytes:
            raise ValueError(f"piece at byte {offset} ({piece.numel()} bytes) is out of order or "
                             f"past the layout's {layout.total_bytes} bytes")
        pos, n = 0, piece.numel()
        while pos < n:
            start, size = chunks[index]
            if offset + pos >= start + size:  # the piece begins past this chunk: it is complete
                yield staging[:size]
                staging.zero_()
                index += 1
                continue
            take = min(n - pos, start + size - offset - pos)
            staging[offset + pos - start:offset + pos - start + take].copy_(piece[pos:pos + take])
            pos += take
        end = offset + n
    for i in range(index, len(chunks)):
        yield staging[:chunks[i][1]]
        staging.zero_()


def _open_for_read(path: Path, buffer_ptr: int) -> tuple[int, bool]:
    if buffer_ptr % PAGE_BYTES == 0 and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the filesystem does not do O_DIRECT
                raise
    return os.open(path, os.O_RDONLY), False


def _safe(tag: str) -> str:
    """A file name for a tag (`teacher:math` -> `teacher_math`)."""
    out = "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)
    if not out or out.startswith("."):
        raise ValueError(f"tag {tag!r} cannot name a file")
    return out
