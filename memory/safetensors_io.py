"""Reading safetensors checkpoints: the one reader of weights written as safetensors (and the
writer of streamed ones).

Role: a checkpoint is a `.safetensors` file, or a directory holding either a Hugging Face
`model.safetensors.index.json` (its `weight_map` names the shards) or `*.safetensors` files (one
`model.safetensors`, or shards without an index). `safetensors_files` resolves it, `read_header`
and `safetensors_shapes` read headers only (no tensor bytes), `iter_safetensors` yields one tensor
at a time (for copying into a preallocated buffer), `tensor_extents` gives where each tensor's
bytes lie in its file (checked against the file's size: for reading a tensor in pieces with
plain reads, as memory/sources.py does to stream a checkpoint with bounded memory),
`load_safetensors` returns {name: tensor}, optionally only some names, on a device, in a dtype,
and `read_safetensors_into` reads a checkpoint straight into existing tensors (the engine's
/update_weights_from_disk: the live model's parameters, no second copy);
`write_safetensors_shards` writes tensors as they are produced, one shard at a time (a sharded
trainer's HF export). Used by the weight
memory (memory/), the engine's /update_weights_from_disk and the trainer's resume.
Invariant: a missing or malformed checkpoint (no such path, no safetensors in the directory, an
index naming a missing shard, a corrupt header, a name asked for that no file holds, a name held
twice) raises ValueError naming the path and what was expected; nothing is read partially silently.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from transport.dtypes import safetensors_dtype, torch_dtype

INDEX_FILE = "model.safetensors.index.json"
_EXPECTED = (f"expected a .safetensors file or a checkpoint directory with model.safetensors "
             f"(or {INDEX_FILE} and its shards)")


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of the checkpoint at `path`, in shard order."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path} is not a safetensors file; {_EXPECTED}")
        return [path]
    if not path.is_dir():
        raise ValueError(f"no checkpoint at {path}: {_EXPECTED}")
    if (path / INDEX_FILE).is_file():
        files = sorted({path / f for f in _weight_map(path).values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{path / INDEX_FILE} names shards that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors in {path}: {_EXPECTED}")
    return files


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is malformed (expected JSON with a weight_map of tensor name "
                         f"-> shard file): {e!r}") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and "/" not in v for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to shard file names")
    return weight_map


def read_header(file: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{name: (dtype, shape)} of one safetensors file, in the order of the data in the file;
    reads the header only."""
    return {name: (dtype, shape) for name, (dtype, shape, _, _) in
            _data_offsets(Path(file))[1].items()}


def safetensors_shapes(path: str | Path) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of the checkpoint, file by file in data order;
    no tensor is read."""
    out, seen = [], set()
    for f in safetensors_files(path):
        for name, (dtype, shape) in read_header(f).items():
            _check_once(name, seen, path)
            out.append((name, dtype, shape))
    return out


@dataclass(frozen=True)
class TensorExtent:
    """Where one tensor's bytes lie: `nbytes` from byte `offset` of `file` (row-major)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def tensor_extents(path: str | Path) -> dict[str, TensorExtent]:
    """{name: TensorExtent} of every tensor of the checkpoint, file by file in data order;
    headers only. ValueError naming the file for a tensor whose byte range disagrees with its
    dtype and shape or lies past the end of the file (a truncated file)."""
    out: dict[str, TensorExtent] = {}
    seen: set[str] = set()
    for f in safetensors_files(path):
        start, entries = _data_offsets(f)
        size = f.stat().st_size
        for name, (dtype, shape, begin, end) in entries.items():
            _check_once(name, seen, path)
            want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != want or start + end > size:
                raise ValueError(f"{f}: {name} is bytes {begin}..{end} of the data section "
                                 f"({want} expected) in a file of {size} bytes")
            out[name] = TensorExtent(f, dtype, shape, start + begin, end - begin)
    return out


def iter_safetensors(path: str | Path, names: Iterable[str] | None = None,
                     device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint, one tensor at a time (file by file, in data order);
    only `names` (each must exist) when given."""
    wanted = None if names is None else set(names)
    files = safetensors_files(path)
    headers = {f: read_header(f) for f in files}
    if wanted is not None:
        missing = wanted - {n for h in headers.values() for n in h}
        if missing:
            raise ValueError(f"checkpoint {path} has no tensor {sorted(missing)[:5]}")
    seen: set[str] = set()
    for f in files:
        keep = [n for n in headers[f] if wanted is None or n in wanted]
        for name in keep:
            _check_once(name, seen, path)
        if not keep:
            continue
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                for name in keep:
                    yield name, fh.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{f} is not a valid safetensors file: {e}") from None


def load_safetensors(path: str | Path, names: Iterable[str] | None = None,
                     device: str | torch.device = "cpu",
                     dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]:
    """{name: tensor} of the checkpoint at `path` (a file or an HF directory, sharded or not),
    only `names` when given, on `device`; with `dtype`, floating-point tensors are cast to it
    (integer and bool tensors keep theirs, as `from_pretrained(dtype=...)` does)."""
    cast = None if dtype is None else torch_dtype(dtype)
    out = {}
    for name, t in iter_safetensors(path, names, device):
        out[name] = t.to(cast) if cast is not None and t.is_floating_point() else t
    return out


def read_safetensors_into(path: str | Path, targets: Mapping[str, torch.Tensor],
                          buffer_device: str = "cpu") -> int:
    """Copy the checkpoint's tensors into `targets` (every name of the checkpoint must be there,
    with its shape), one tensor at a time, returning the bytes read. Names, shapes and every
    tensor's byte range (a truncated file) are checked before the first byte is written. A
    contiguous CPU target of the file's dtype is filled by reading the file straight into its
    memory: no intermediate tensor, nothing mapped. Any other target (another dtype, a GPU) goes
    through one buffer of that tensor's size. The live model is never duplicated."""
    files = [(f, *_data_offsets(f)) for f in safetensors_files(path)]
    seen: set[str] = set()
    for f, start, entries in files:  # everything checked before the first byte moves
        size = f.stat().st_size
        for name, (dtype, shape, begin, end) in entries.items():
            _check_once(name, seen, path)
            if name not in targets or tuple(targets[name].shape) != shape:
                raise ValueError(f"{f}: {name} {shape} has no target of that shape")
            want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != want or start + end > size:
                raise ValueError(f"{f}: {name} is bytes {begin}..{end} of the data section "
                                 f"({want} expected) in a file of {size} bytes")
    total = 0
    for f, start, entries in files:
        with open(f, "rb", buffering=0) as fh:
            for name, (dtype, shape, begin, end) in entries.items():
                dst = targets[name]
                direct = dst.device.type == "cpu" and dst.dtype == dtype and dst.is_contiguous()
                tmp = dst.detach() if direct else torch.empty(shape, dtype=dtype,
                                                               device=buffer_device)
                fh.seek(start + begin)
                _read_exactly(fh, tmp.reshape(-1).view(torch.uint8).numpy(), f, name)
                if not direct:
                    with torch.no_grad():
                        dst.copy_(tmp)
                total += end - begin
    return total


def _data_offsets(file: Path) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int,
                                                              int]]]:
    """(byte offset of the data section, {name: (dtype, shape, begin, end)} in data order)."""
    try:
        with open(file, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 2 <= n <= file.stat().st_size - 8:
                raise ValueError(f"header length {n} does not fit the file")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        out = {name: (safetensors_dtype(h["dtype"]), tuple(int(s) for s in h["shape"]),
                      int(h["data_offsets"][0]), int(h["data_offsets"][1])) for name, h in items}
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"{file} is not a valid safetensors file: {e}") from None
    return 8 + n, out


def _read_exactly(fh, out, file: Path, name: str) -> None:
    view = memoryview(out).cast("B")
    got = 0
    while got < len(view):
        n = fh.readinto(view[got:])
        if not n:
            raise ValueError(f"{file} ends inside {name} ({got} of {len(view)} bytes read)")
        got += n


def _check_once(name: str, seen: set[str], path: str | Path) -> None:
    if name in seen:
        raise ValueError(f"checkpoint {path} holds {name!r} in more than one file")
    seen.add(name)


DEFAULT_SHARD_BYTES = 512 << 20  # the weight push's default bucket: one export shard


def write_safetensors_shards(named: Iterable[tuple[str, torch.Tensor]], directory: str | Path,
                             shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Write (name, tensor) pairs as they come into `directory` as shards of at most
    `shard_bytes` (a bigger tensor alone): `model.safetensors` when one shard holds them all,
    else `model-00001.safetensors`, ... and an `INDEX_FILE` whose `weight_map` names them (what
    `safetensors_files`, transformers and SGLang read). Holds one shard in memory, never the
    whole model: a streamed source (a sharded trainer's gather) is written as it is produced.
    Returns the bytes written (tensor data)."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    files: list[str] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in shard.items()},
                  str(directory / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, tensor in named:
        if name in weight_map or name in shard:
            raise ValueError(f"tensor {name!r} given twice for {directory}")
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = tensor
        size += nbytes
        total += nbytes
    if shard or not files:
        flush()
    for stale in [directory / INDEX_FILE, directory / "model.safetensors"]:
        stale.unlink(missing_ok=True)
    if len(files) == 1:
        (directory / files[0]).replace(directory / "model.safetensors")
    else:
        (directory / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total
