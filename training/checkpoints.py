"""Checkpoint directories that are complete or absent: written atomically, verified on resume.

A checkpoint `step_<N>` is written into `step_<N>.tmp`, then `manifest.json` (every file's size
and CRC-32) is written last and the directory renamed into place, so a crash leaves at most a
`.tmp` directory that resume ignores. On resume, `resumable_checkpoint` checks the newest
checkpoint against its manifest (a truncated or bit-flipped file, a missing file, a damaged
manifest) and falls back to the newest intact one, reporting every one it skipped and why.
Directories without a manifest (written before manifests existed) are accepted unverified when
their `trainer_state.pt` is present.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.pt"
CHUNK = 8 << 20


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_checkpoint(path: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp_dir)`, add the manifest, then move the directory to `path` atomically
    (an existing `path` is replaced)."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "crc32": file_crc32(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if path.exists():
        shutil.rmtree(path)
    tmp.replace(path)
    return path


def verify_checkpoint(path: Path) -> str:
    """What is wrong with the checkpoint at `path` ("" when it is intact)."""
    manifest = path / MANIFEST
    if not manifest.exists():
        return "" if (path / STATE_FILE).exists() else f"no {MANIFEST} and no {STATE_FILE}"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST}: {e}"
    for name, want in files.items():
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {want['bytes']}"
        if file_crc32(p) != want["crc32"]:
            return f"{name} fails its CRC-32 (corrupted on disk)"
    return ""


def resumable_checkpoint(folder: Path) -> tuple[Path | None, list[str]]:
    """(the newest intact checkpoint or None, one line per newer checkpoint skipped and why)."""
    skipped: list[str] = []
    candidates = sorted((p for p in folder.glob("step_*") if p.is_dir()
                         and not p.name.endswith(".tmp")), reverse=True)
    for path in candidates:
        problem = verify_checkpoint(path)
        if not problem:
            return path, skipped
        skipped.append(f"{path.name}: {problem}")
        log.warning("checkpoint %s is not usable (%s); trying the one before", path, problem)
    return None, skipped
