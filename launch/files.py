"""Files the launcher writes into the run directory, whole or not at all.

Invariant: a reader (a resumed run, `launch.watch`, a person) finds either the previous complete
file or the new complete one, never a part: the text goes to `<name>.tmp` first and is renamed
over the file; on a failure (a full disk) the temporary file is removed and the error raised.
`Reserved` takes the room of a file written at the end (exit.json) when the run starts.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """`text` into `path` atomically, the file's permissions `mode`; OSError (nothing changed
    at `path`) when it cannot."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
            os.fchmod(f.fileno(), mode)  # whatever the umask, and a leftover .tmp's mode
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_json(path: Path, doc: dict, mode: int = 0o644) -> None:
    """`doc` as indented JSON into `path` atomically (write_text)."""
    write_text(path, json.dumps(doc, indent=2), mode)


class Reserved:
    """Room for a file written at the end of the run, taken at its start (`size` bytes of
    `<name>.tmp`, allocated): a disk that fills meanwhile still gets that file whole, when it is
    no larger. Without the room (a disk full already), `write` is plain `write_text`."""

    def __init__(self, path: Path, size: int = 1 << 20):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.fd: int | None = None
        try:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.posix_fallocate(self.fd, 0, size)
        except OSError:
            self._drop()

    def write(self, text: str) -> None:
        """`text` into the file atomically, in the room taken; OSError (nothing changed at the
        path) when it cannot."""
        if self.fd is None:
            write_text(self.path, text)
            return
        fd, self.fd, data = self.fd, None, text.encode()
        try:
            done = 0
            while done < len(data):  # into the allocated blocks: none new is needed
                done += os.pwrite(fd, data[done:], done)
            os.ftruncate(fd, len(data))
            os.close(fd)
            os.replace(self.tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                self.tmp.unlink()
            raise

    def _drop(self) -> None:
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            if fd is not None:
                os.close(fd)
            self.tmp.unlink()
