"""Checksums of weight sets: a CRC-32 per chunk of a flat buffer, and the one error a failed check
raises.

Every tier that keeps a copy of a set checks it this way: the NVMe tier (memory/nvme.py) keeps a
CRC-32 of every chunk in the set's manifest and verifies each chunk it reads; the host tier
(memory/store.py) computes them when a host copy is written and verifies them at the first
restore after. A mismatch raises `ChecksumError`, naming the set, which copy (`where`) and the
byte offset and size of the first bad chunk; another process's error message is turned back into
one with `ChecksumError.parse` (the prefetcher's replies). It guards against accidental writes
and bad disks, not against an adversary.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import zlib

import numpy as np

from transport.errors import RlxError

CRC_THREADS = 8  # at most, for a buffer of several chunks (zlib releases the GIL)

_MESSAGE = re.compile(r"weight set '(?P<tag>.*)': (?P<where>.+?) at byte offset (?P<offset>\d+) "
                      r"\((?P<nbytes>\d+) bytes\) (?P<reason>fails its .*)$")


class ChecksumError(RlxError, RuntimeError):
    """A copy of weight set `tag` differs from its checksums at byte `offset` (`nbytes` long)."""

    def __init__(self, tag: str, offset: int, nbytes: int, where: str = "NVMe chunk",
                 reason: str = "fails its checksum"):
        super().__init__(f"weight set {tag!r}: {where} at byte offset {offset} ({nbytes} bytes) "
                         f"{reason}")
        self.tag, self.offset, self.nbytes, self.where = tag, offset, nbytes, where
        self.reason = reason

    @classmethod
    def parse(cls, message: str) -> ChecksumError | None:
        """The error whose message `message` ends with (e.g. a remote process's), or None."""
        for line in reversed(message.strip().splitlines()):
            m = _MESSAGE.search(line.strip())
            if m:
                return cls(m["tag"], int(m["offset"]), int(m["nbytes"]), m["where"], m["reason"])
        return None


def chunk_crcs(flat: np.ndarray, chunk_bytes: int) -> list[int]:
    """CRC-32 of each `chunk_bytes` slice of the 1-D uint8 array `flat` (the last one shorter);
    several chunks on several threads."""
    chunks = [flat[o:o + chunk_bytes] for o in range(0, flat.size, chunk_bytes)]
    threads = min(CRC_THREADS, os.cpu_count() or 1, len(chunks))
    if threads < 2:
        return [zlib.crc32(c) for c in chunks]
    with concurrent.futures.ThreadPoolExecutor(threads, "weight-crc") as pool:
        return list(pool.map(zlib.crc32, chunks))
