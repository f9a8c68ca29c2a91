"""Files the launcher writes into the run directory, whole or not at all.

Invariant: a reader (a resumed run, `launch.watch`, a person) finds either the previous complete
file or the new complete one, never a part: the text goes to `<name>.tmp` first and is renamed
over the file; on a failure (a full disk) the temporary file is removed and the error raised.
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
