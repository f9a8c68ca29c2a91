"""Encode/decode schema messages to multipart frames; tensors travel as separate raw frames.

Invariant: a tensor's bytes are never copied into the msgpack header. On send, each torch tensor or
numpy array in a body becomes an extension value `[dtype, shape, frame_index]` in the header and its
(contiguous) memory is handed to zmq as its own frame without a copy; on receive, the tensor is a
view over the received frame (zero-copy). Large tensors between processes of one host may instead
go through a shared-memory arena (`transport.shm`), referenced the same way. Pickle is never used.
Every decode failure is a `WireError` carrying an `ErrorCode`, so callers can answer or count it.

Receiving untrusted bytes, in this order: `peek_envelope` reads version, kind and request id from
the first bytes (bounded, no recursion; for attributing errors); the `Limits` on frames and bytes
are checked; `scan_header` walks the header's structure iteratively against the depth, container,
number and object limits without building anything; only then is it decoded, typed (the schema
bounds the depth; tensor references decode typed too). Nothing untrusted is ever decoded untyped,
and `decode` raises nothing but WireError.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np

from transport.dtypes import NUMPY_DTYPES, torch_dtype, wire_itemsize
from transport.errors import RlxError
from transport.schema import PROTOCOL_VERSION, ErrorCode, Header, Kind, Msg, Tensor, header_type

if TYPE_CHECKING:
    import torch

EXT_TENSOR = 1  # payload: [dtype, shape, frame_index]
EXT_SHM = 2  # payload: [dtype, shape, segment, nbytes]
_EXT_META = {EXT_TENSOR: msgspec.msgpack.Decoder(tuple[str, list[int], int]),
             EXT_SHM: msgspec.msgpack.Decoder(tuple[str, list[int], str | int, int])}


class Limits(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Per-socket limits on received messages ([limits] in hosts.toml), all checked before the
    header is decoded; anything over them is refused and counted, never decoded."""

    max_frames: int = 4096  # tensor frames per message (count)
    max_message_bytes: int = 4 << 30  # header plus all frames (bytes; 4 GiB)
    max_header_bytes: int = 256 << 20  # the msgpack header frame alone (bytes; 256 MiB)
    max_depth: int = 16  # arrays/maps nested in the header (levels; the schema needs 6)
    max_container_len: int = 1 << 22  # entries in one header array or map (count; 4 Mi)
    max_header_items: int = 1 << 21  # arrays, maps, strings, binaries and extensions in the
    # whole header, all levels (count; 2 Mi): each may be walked one by one (up to ~1 us) and
    # decodes to an object of ~60 bytes or more. A TrainBatch holds ~20 per sample (teacher
    # top-k arrays travel as tensor frames, not in the header); a max_header_bytes header of
    # one-element rows holds ~2 Mi
    max_header_numbers: int = 1 << 25  # ints, floats, bools and nils in the whole header
    # (count; 32 Mi): each decodes to 8-40 bytes; runs of one size and rows laid out alike are
    # scanned vectorised, mixed sizes at up to ~70 ns each. A TrainBatch holds ~4 per response
    # token: 1 Mi for 64 samples x 4096 tokens (5.9 MiB of header)

    def __post_init__(self):
        for name in self.__struct_fields__:
            low = 0 if name == "max_frames" else 1  # max_frames = 0: no tensor frames at all
            if getattr(self, name) < low:
                raise ValueError(f"limits: {name} must be >= {low}, got {getattr(self, name)}")


class WireError(RlxError):
    """A message that cannot be accepted; `code` is an ErrorCode, `req_id` 0 if unknown."""

    def __init__(self, code: ErrorCode, message: str, req_id: int = 0, kind: int = 0):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.req_id, self.kind = code, message, req_id, kind


@dataclass
class Decoded:
    kind: Kind
    req_id: int
    body: Msg


def _torch_tensor(obj: Any) -> bool:
    """Whether `obj` is a torch tensor (never imports torch: without it, nothing is one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def flat_bytes(obj: Any) -> tuple[str, list[int], Any]:
    """(dtype name, shape, bytes) of a torch tensor or numpy array; the bytes are a flat uint8
    array over its (contiguous, CPU) memory, or b"" when it is empty. TypeError for anything that
    cannot travel as a tensor frame."""
    if isinstance(obj, np.ndarray):
        name = obj.dtype.name
        if name not in NUMPY_DTYPES or not obj.dtype.isnative:
            raise TypeError(f"numpy dtype {obj.dtype} cannot travel as a tensor frame")
        shape = list(obj.shape)
        flat = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
    elif _torch_tensor(obj):
        import torch

        t = obj.cpu() if obj.device.type != "cpu" else obj
        t = t.resolve_conj().resolve_neg().contiguous()
        name, shape = str(t.dtype).removeprefix("torch."), list(t.shape)
        flat = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else None
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire")
    return name, shape, flat if flat is not None and flat.size else b""


def tensor_frame(t: Any) -> Any:
    """The tensor's (or array's) bytes as a buffer zmq can send without copying."""
    return flat_bytes(t)[2]


def checked_numel(shape: Any) -> int:
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise WireError(ErrorCode.UNDECODABLE, f"bad tensor shape {shape!r}")
    numel = 1
    for s in shape:
        numel *= s
    return numel


def checked_nbytes(dtype: Any, shape: Any) -> int:
    """Bytes of a `dtype`-`shape` tensor; WireError for an unknown dtype or a bad shape."""
    size = wire_itemsize(dtype) if isinstance(dtype, str) else None
    if size is None:
        raise WireError(ErrorCode.UNDECODABLE, f"unknown dtype {dtype!r}")
    return checked_numel(shape) * size


class WireArray:
    """A received tensor before its field's type is known: its bytes (a view over the frame or a
    shared-memory segment), dtype name and shape, checked to agree. The decoder turns it into a
    numpy array (`np.ndarray` fields) or a torch tensor (`Tensor` fields, importing torch then)."""

    __slots__ = ("buf", "dtype", "shape")

    def __init__(self, buf: Any, dtype: Any, shape: Any):
        nbytes = checked_nbytes(dtype, shape)
        got = buf.nbytes if isinstance(buf, (memoryview, np.ndarray)) else len(buf)
        if got != nbytes:
            raise WireError(ErrorCode.UNDECODABLE, f"tensor frame holds {got} bytes, "
                            f"{dtype}{list(shape)} needs {nbytes}")
        self.buf, self.dtype, self.shape = buf, dtype, tuple(shape)

    def _writable(self) -> Any:
        buf = self.buf
        return memoryview(bytearray(buf)) if isinstance(buf, memoryview) and buf.readonly \
            else buf

    def numpy(self) -> np.ndarray:
        dtype = NUMPY_DTYPES.get(self.dtype)
        if dtype is None:
            raise ValueError(f"{self.dtype} has no numpy equivalent; declare the field "
                             f"torch.Tensor")
        if 0 in self.shape:
            return np.empty(self.shape, dtype=dtype)
        if isinstance(self.buf, np.ndarray):  # a shared-memory view: keeps its segment mapped
            return self.buf.view(dtype).reshape(self.shape)
        return np.frombuffer(self._writable(), dtype=dtype).reshape(self.shape)

    def torch(self) -> torch.Tensor:
        import torch

        tdtype = torch_dtype(self.dtype)
        if 0 in self.shape:
            return torch.empty(self.shape, dtype=tdtype)
        if isinstance(self.buf, np.ndarray):  # a shared-memory view: keeps its segment mapped
            return torch.from_numpy(self.buf).view(tdtype).reshape(self.shape)
        return torch.frombuffer(self._writable(), dtype=tdtype).reshape(self.shape)


class Codec:
    """One per socket owner (not thread-safe: it keeps the frames of the message in progress)."""

    def __init__(self, limits: Limits | None = None, shm: Any = None):
        self.limits = limits or Limits()
        self.shm = shm  # transport.shm.ShmChannel or None
        self._out: list[Any] = []
        self._in: Sequence[Any] = ()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._ext_encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(header_type(), ext_hook=self._ext_hook,
                                                dec_hook=self._dec_hook)

    # -------------------------------------------------------------------------------- encode
    def encode(self, kind: Kind, req_id: int, body: Msg) -> list[Any]:
        """Header frame followed by one frame per tensor in `body`."""
        self._out = []
        try:
            head = self._encoder.encode(Header(PROTOCOL_VERSION, kind, req_id, body))
            return [head, *self._out]
        finally:
            self._out = []

    def _enc_hook(self, obj: Any) -> Any:
        if not isinstance(obj, np.ndarray) and not _torch_tensor(obj):
            raise NotImplementedError(f"cannot encode {type(obj).__name__} on the wire")
        name, shape, flat = flat_bytes(obj)
        if self.shm is not None and self.shm.accepts(len(flat)):
            ref = self.shm.put(flat)
            return msgspec.msgpack.Ext(EXT_SHM, self._ext_encoder.encode([name, shape, *ref]))
        index = len(self._out)
        self._out.append(flat)
        return msgspec.msgpack.Ext(EXT_TENSOR, self._ext_encoder.encode([name, shape, index]))

    # -------------------------------------------------------------------------------- decode
    def decode(self, frames: Sequence[Any]) -> Decoded:
        """Decode [header, *tensor_frames]; frames may be zmq.Frame, bytes or memoryviews.
        Every limit is checked, and the header's structure scanned (bounded, no recursion),
        before anything is decoded; every failure is a WireError, nothing else escapes."""
        if not frames:
            raise WireError(ErrorCode.UNDECODABLE, "empty message")
        head = _view(frames[0])
        env = peek_envelope(head)
        try:
            views = self._checked_views(head, frames, env)
            scan_header(views[0], self.limits)
            header = self._decode_header(views, env)
        except WireError as e:
            e.req_id, e.kind = env.req_id, env.kind
            raise
        return Decoded(header.kind, header.id, header.body)

    def _checked_views(self, head: memoryview, frames: Sequence[Any],
                       env: Envelope) -> list[memoryview]:
        lim = self.limits
        if len(frames) - 1 > lim.max_frames:
            raise WireError(ErrorCode.TOO_LARGE, f"{len(frames) - 1} frames, limit is "
                            f"{lim.max_frames} (limits.max_frames)")
        views = [head, *map(_view, frames[1:])]
        if views[0].nbytes > lim.max_header_bytes:
            raise WireError(ErrorCode.TOO_LARGE, f"header of {views[0].nbytes} bytes, limit is "
                            f"{lim.max_header_bytes} (limits.max_header_bytes)")
        total = sum(v.nbytes for v in views)
        if total > lim.max_message_bytes:
            raise WireError(ErrorCode.TOO_LARGE, f"message of {total} bytes, limit is "
                            f"{lim.max_message_bytes} (limits.max_message_bytes)")
        if env.v is not None and env.v != PROTOCOL_VERSION:
            raise WireError(ErrorCode.PROTOCOL_MISMATCH, f"peer speaks protocol {env.v}, this "
                            f"actor speaks {PROTOCOL_VERSION}")
        return views

    def _decode_header(self, views: list[memoryview], env: Envelope) -> Header:
        """Typed decode (depth bounded by the schema) of a header that passed the scan."""
        self._in = views
        try:
            header = self._decoder.decode(views[0])
        except WireError:
            raise
        except msgspec.DecodeError as e:  # ValidationError included
            raise _classify(views[0], env, e) from None
        except Exception as e:  # noqa: BLE001 - a receive boundary: nothing but WireError leaves
            raise WireError(ErrorCode.UNDECODABLE, f"header not decodable: "
                            f"{type(e).__name__}: {e}") from None
        finally:
            self._in = ()
        if header.v != PROTOCOL_VERSION:
            raise WireError(ErrorCode.PROTOCOL_MISMATCH, f"peer speaks protocol {header.v}, this "
                            f"actor speaks {PROTOCOL_VERSION}")
        return header

    def _ext_hook(self, code: int, data: memoryview) -> WireArray:
        try:
            if code not in _EXT_META:
                raise WireError(ErrorCode.UNDECODABLE, f"unsupported extension code {code}")
            meta = _EXT_META[code].decode(data)  # typed: no recursion, no untyped objects
            dtype, shape = meta[0], list(meta[1])
            if code == EXT_TENSOR:
                index = meta[2]
                if not 0 <= index < len(self._in) - 1:
                    raise WireError(ErrorCode.TRUNCATED, f"tensor frame {index} is missing")
                return WireArray(self._in[1 + index], dtype, shape)
            if code == EXT_SHM and self.shm is not None:
                return self.shm.get_raw(dtype, shape, meta[2:])
        except WireError:
            raise
        except (msgspec.DecodeError, LookupError, TypeError, ValueError, RuntimeError,
                OSError) as e:
            raise WireError(ErrorCode.UNDECODABLE, f"bad tensor reference: {e}") from None
        raise WireError(ErrorCode.UNDECODABLE, f"unsupported extension code {code}")

    @staticmethod
    def _dec_hook(tp: type, obj: Any) -> Any:
        if isinstance(obj, WireArray):
            if tp is np.ndarray:
                return obj.numpy()
            if tp is Tensor or _torch_tensor_type(tp):
                return obj.torch()
        raise NotImplementedError(f"cannot decode {type(obj).__name__} as {tp}")


def _torch_tensor_type(tp: type) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and tp is torch.Tensor


def _view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer (writable, zero-copy)
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


# ------------------------------------------------------------------------------ bounded peek
class Envelope(NamedTuple):
    """What the first bytes of a header frame say; read without decoding the rest."""

    v: int | None  # protocol version; None unless the frame starts like a header
    kind: int  # a Kind, or 0 when the frame is not header-shaped (no error is attributed)
    req_id: int  # 0 when not attributable
    body_at: int  # offset of the body map (-1: none); `body_type()` reads its tag lazily


_NO_ENVELOPE = Envelope(None, 0, 0, -1)
_KINDS = frozenset(int(k) for k in Kind)
_MAP32 = (0xde, 0xdf)  # map16, map32 heads (fixmaps are 0x80-0x8f)
_INT_WIDTH = {0xcc: (1, False), 0xcd: (2, False), 0xce: (4, False), 0xcf: (8, False),
              0xd0: (1, True), 0xd1: (2, True), 0xd2: (4, True), 0xd3: (8, True)}
_HEAD_WIDTH = {0xdc: ("array", 2), 0xdd: ("array", 4), 0xde: ("map", 2), 0xdf: ("map", 4),
               0xd9: ("str", 1), 0xda: ("str", 2), 0xdb: ("str", 4)}


def _fixed(mv: memoryview, p: int, n: int, signed: bool = False) -> int:
    if p + n > len(mv):
        raise IndexError("truncated")
    return int.from_bytes(mv[p:p + n], "big", signed=signed)


def _read_int(mv: memoryview, p: int) -> tuple[int, int]:
    """(value, next offset) of the msgpack integer at p; KeyError if it is not one."""
    b = mv[p]
    if b < 0x80 or b >= 0xe0:
        return (b if b < 0x80 else b - 0x100), p + 1
    n, signed = _INT_WIDTH[b]
    return _fixed(mv, p + 1, n, signed), p + 1 + n


def _read_head(mv: memoryview, p: int) -> tuple[str, int, int]:
    """(major type, length, next offset) for an array/map/str head at p, ("", 0, p) else."""
    b = mv[p]
    for major, lo, mask in (("map", 0x80, 0x0f), ("array", 0x90, 0x0f), ("str", 0xa0, 0x1f)):
        if lo <= b <= lo + mask:
            return major, b & mask, p + 1
    if b not in _HEAD_WIDTH:
        return "", 0, p
    major, n = _HEAD_WIDTH[b]
    return major, _fixed(mv, p + 1, n), p + 1 + n


def peek_envelope(mv: memoryview) -> Envelope:
    """(version, kind, request id, body offset) from a header's first bytes: reads at most
    ~30 bytes, never recurses, never builds untrusted objects. kind and req_id are only set for
    a frame shaped like a header ([int, Kind, int >= 0, {...}]), so that an error answer goes
    only where a request can be attributed."""
    try:
        if mv[0] != 0x94:  # fixarray of 4: how every header starts
            return _NO_ENVELOPE
        v, kind = mv[1], mv[2]
        if v < 0x80 and kind < 0x80:  # the usual: both positive fixints
            req_id, p = _read_int(mv, 3)
        else:
            v, p = _read_int(mv, 1)
            kind, p = _read_int(mv, p)
            req_id, p = _read_int(mv, p)
        if kind not in _KINDS or req_id < 0 or not (0x80 <= mv[p] <= 0x8f or mv[p] in _MAP32):
            return Envelope(v, 0, 0, -1)
        return Envelope(v, kind, req_id, p)
    except (IndexError, KeyError, ValueError):
        return _NO_ENVELOPE


def body_type(mv: memoryview, env: Envelope) -> str:
    """The body's "type" tag (at most 64 characters), "" when it cannot be read."""
    try:
        major, entries, p = _read_head(mv, env.body_at) if env.body_at >= 0 else ("", 0, 0)
        major, n, p = _read_head(mv, p) if entries else ("", 0, p)
        if (major, bytes(mv[p:p + n])) != ("str", b"type"):
            return ""
        major, n, p = _read_head(mv, p + n)
        return bytes(mv[p:p + min(n, 64)]).decode("utf-8", "replace") if major == "str" else ""
    except (IndexError, ValueError):
        return ""


def _classify(mv: memoryview, env: Envelope, err: Exception) -> WireError:
    text = str(err)
    if "Invalid value" in text and "$[3].type" in text:
        return WireError(ErrorCode.UNKNOWN_MESSAGE,
                         f"unknown message type {body_type(mv, env)!r}")
    return WireError(ErrorCode.UNDECODABLE, f"invalid message: {text}")


# ------------------------------------------------------------------------------ bounded scan
def _value_sizes(numbers_only: bool) -> list[int]:
    """Size in bytes of each fixed-size msgpack value by its first byte (0: not fixed-size).
    Numbers are nil, bool, int and float; the other fixed-size values (fixstr, fixext, and
    empty arrays and maps: they hold nothing) are objects, left out with `numbers_only`."""
    size = [0] * 256
    for b in [*range(0x80), *range(0xe0, 0x100), 0xc0, 0xc2, 0xc3]:
        size[b] = 1
    for b, n in {0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9, 0xd0: 2, 0xd1: 3,
                 0xd2: 5, 0xd3: 9}.items():
        size[b] = n
    if not numbers_only:
        size[0x80] = size[0x90] = 1
        for b in range(0xa0, 0xc0):
            size[b] = 1 + (b & 0x1f)
        for b, n in {0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18}.items():
            size[b] = n
    return size


_LEAF = _value_sizes(numbers_only=False)
_NUMBER = _value_sizes(numbers_only=True)
_SIZE_CLASS = {n: bytes(b for b in range(256) if _LEAF[b] == n) for n in set(_LEAF) - {0}}
_NUMBER_CLASS = {n: bytes(b for b in range(256) if _NUMBER[b] == n) for n in set(_NUMBER) - {0}}
_NUMBER_BYTES = bytes(b for b in range(256) if _NUMBER[b])
# str/bin/ext with a length prefix: first byte -> (bytes of the length, extra bytes before data)
_VAR = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1),
        0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0)}
# containers: first byte -> (bytes of the count, values per entry)
_CONT = {**{b: (0, 2) for b in range(0x81, 0x90)}, **{b: (0, 1) for b in range(0x91, 0xa0)},
         0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}
_STRIDE_MIN = 32  # containers at least this long first try skipping their values at once
_SMALL_HEADER = 4096  # headers up to this many bytes may skip the walk (see scan_header)
_NOT_CONTAINER = bytes(b for b in range(256) if b not in _CONT)  # bytes that cannot nest


def scan_header(buf: memoryview, limits: Limits) -> None:
    """Walk the msgpack structure of a header without building anything, checking nesting
    depth, container lengths, and the numbers and the objects (everything else) in it against
    `limits`; TOO_LARGE or UNDECODABLE WireError. Iterative (an explicit stack), so deep
    nesting cannot recurse; a container of same-size leaves (log-probs, masks) or of rows of
    numbers laid out alike (top-k log-probs) is skipped vectorised, and a small header that
    provably fits every limit (`_within_limits_by_size`) is not walked at all."""
    mv = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
    if _within_limits_by_size(mv, limits):
        return
    try:
        end = _walk(mv, limits)
    except IndexError:
        raise WireError(ErrorCode.UNDECODABLE, "header is truncated (a value runs past "
                        "its end)") from None
    if end != mv.nbytes:
        raise WireError(ErrorCode.UNDECODABLE, f"{mv.nbytes - end} trailing bytes after the "
                        f"header")


def _within_limits_by_size(mv: memoryview, limits: Limits) -> bool:
    """True when a small header provably cannot break a limit, so the walk can be skipped:
    every value takes at least a byte (so neither numbers, objects nor one container's entries
    can outnumber the bytes) and every level of nesting starts with a container byte (counted
    anywhere, an over-count). Truncation and garbage are then left to the typed decode."""
    n = mv.nbytes
    if n > min(_SMALL_HEADER, limits.max_header_items, limits.max_header_numbers,
               limits.max_container_len):
        return False
    return len(bytes(mv).translate(None, _NOT_CONTAINER)) < limits.max_depth


def _walk(mv: memoryview, limits: Limits) -> int:
    """Offset just past the first msgpack value of mv; see scan_header. Stack entries are the
    values left in each open container, negative for a container not yet started. Objects are
    counted and checked one by one, numbers per run of them: the walk passes max_header_numbers
    by at most one container's values before it stops."""
    number, leaf, nbytes = _NUMBER, _LEAF, mv.nbytes
    max_numbers, max_objects = limits.max_header_numbers, limits.max_header_items
    max_depth, max_entries = limits.max_depth, limits.max_container_len
    stack, p, numbers, objects = [-1], 0, 0, 0
    while stack:
        left = stack.pop()
        if left <= -_STRIDE_MIN:
            p, left, nums, objs = _skip_uniform(mv, p, -left, len(stack) + 1, limits)
            numbers, objects = numbers + nums, objects + objs
        left = abs(left)
        while left:
            for i in range(left):  # the hot loop: a run of numbers
                size = number[mv[p]]
                if not size:
                    break
                p += size
            else:
                numbers += left
                break
            numbers, objects, left = numbers + i, objects + 1, left - i - 1
            if numbers > max_numbers or objects > max_objects:
                break
            b = mv[p]
            if b in _CONT:
                width, per = _CONT[b]
                entries = (b & 0x0f if not width else mv[p + 1] << 8 | mv[p + 2] if width == 2
                           else _fixed(mv, p + 1, width))
                p += 1 + width
                values = entries * per
                if values > nbytes - p or len(stack) >= max_depth or entries > max_entries:
                    _check_container(entries, per, len(stack) + 1, nbytes - p, limits)
                if values >= _STRIDE_MIN:
                    stack += [left, -values]
                    break
                for j in range(values):  # a short container (a top-k row): walked in place
                    size = number[mv[p]]
                    if not size:
                        break
                    p += size
                else:
                    numbers += values
                    continue
                numbers += j
                stack += [left, values - j]
                break
            elif leaf[b]:  # fixstr, fixext, empty array or map
                p += leaf[b]
            elif b in _VAR:
                width, extra = _VAR[b]
                p += 1 + width + extra + _fixed(mv, p + 1, width)
            else:
                raise WireError(ErrorCode.UNDECODABLE, f"byte 0x{b:02x} at offset {p} does "
                                f"not start a msgpack value")
        if numbers > max_numbers or objects > max_objects:
            _check_counts(numbers, objects, limits)
    if p > nbytes:
        raise IndexError(p)
    return p


def _skip_uniform(mv: memoryview, p: int, count: int, depth: int,
                  limits: Limits) -> tuple[int, int, int, int]:
    """(offset, values left, numbers, objects) after trying to skip a container's `count`
    values at once: same-size leaves, or short rows of numbers laid out alike (each row an array
    at `depth`); (p, count, 0, 0) when they are neither."""
    size = _LEAF[mv[p]]
    if size:  # every size-th byte from p must start such a leaf (checked in C)
        stop = p + count * size
        firsts = mv[p:stop:size].tobytes() if stop <= mv.nbytes else b""
        if firsts and not firsts.translate(None, _SIZE_CLASS[size]):
            objects = len(firsts.translate(None, _NUMBER_BYTES))
            return stop, 0, count - objects, objects
        return p, count, 0, 0
    row = _row_layout(mv, p)
    if row is None:
        return p, count, 0, 0
    length, layout = row
    stop = p + count * length
    if stop > mv.nbytes:
        return p, count, 0, 0
    # every row has the first row's head bytes and, at each of its entries' offsets, a number
    # of that entry's size (strided copies, in C): then each row is `length` bytes as well
    if all(mv[p + i:stop:length].tobytes().count(mv[p + i]) == count
           for i in range(layout[0][0])) \
            and all(not mv[p + at:stop:length].tobytes().translate(None, _NUMBER_CLASS[size])
                    for at, size in layout):
        _check_container(len(layout), 1, depth, mv.nbytes - p, limits)
        return stop, 0, count * len(layout), count
    return p, count, 0, 0


def _row_layout(mv: memoryview, p: int) -> tuple[int, list[tuple[int, int]]] | None:
    """(length, [(offset, size) of each entry]) when the value at p is a short array (1 to
    _STRIDE_MIN - 1 entries: longer ones are skipped on their own) of numbers, else None.
    Short, so that checking rows against it stays a few dozen C calls."""
    b = mv[p]
    if b not in _CONT or _CONT[b][1] != 1:
        return None
    width = _CONT[b][0]
    entries = _fixed(mv, p + 1, width) if width else b & 0x0f
    if not 0 < entries < _STRIDE_MIN:
        return None
    at, layout = 1 + width, []
    for _ in range(entries):
        size = _NUMBER[mv[p + at]]
        if not size:
            return None
        layout.append((at, size))
        at += size
    return at, layout


def _check_container(entries: int, per: int, depth: int, remaining: int,
                     limits: Limits) -> None:
    """Check a container of `entries` (of `per` values each) opening at `depth`."""
    if entries * per > remaining:
        raise WireError(ErrorCode.UNDECODABLE, f"a container declares {entries} entries but "
                        f"only {remaining} bytes follow")
    if depth > limits.max_depth:
        raise WireError(ErrorCode.TOO_LARGE, f"header nests deeper than {limits.max_depth} "
                        f"levels (limits.max_depth)")
    if entries > limits.max_container_len:
        raise WireError(ErrorCode.TOO_LARGE, f"a container of {entries} entries, limit is "
                        f"{limits.max_container_len} (limits.max_container_len)")


def _check_counts(numbers: int, objects: int, limits: Limits) -> None:
    if objects > limits.max_header_items:
        raise WireError(ErrorCode.TOO_LARGE, f"header holds more than {limits.max_header_items} "
                        f"arrays, maps, strings, binaries and extensions (limits.max_header_items)")
    if numbers > limits.max_header_numbers:
        raise WireError(ErrorCode.TOO_LARGE, f"header holds more than "
                        f"{limits.max_header_numbers} numbers (limits.max_header_numbers)")
