"""Encode/decode schema messages to multipart frames; tensors travel as separate raw frames.

Invariant: a tensor's bytes are never copied into the msgpack header. On send, each torch tensor or
numpy array in a body becomes an extension value `[dtype, shape, frame_index]` in the header and its
(contiguous) memory is handed to zmq as its own frame without a copy; on receive, the tensor is a
view over the received frame (zero-copy). Large tensors between processes of one host may instead
go through a shared-memory arena (`transport.shm`), referenced the same way. Pickle is never used.
Every decode failure is a `WireError` carrying an `ErrorCode`, so callers can answer or count it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgspec
import numpy as np
import torch

from transport.schema import PROTOCOL_VERSION, ErrorCode, Header, Kind, Msg

EXT_TENSOR = 1  # payload: [dtype, shape, frame_index]
EXT_SHM = 2  # payload: [dtype, shape, segment, offset, slot]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.itemsize > 0
}


class Limits(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Per-socket limits on received messages; anything over them is refused and counted."""

    max_frames: int = 4096  # tensor frames per message
    max_message_bytes: int = 4 << 30  # header plus all frames


class WireError(Exception):
    """A message that cannot be accepted; `code` is an ErrorCode, `req_id` 0 if unknown."""

    def __init__(self, code: ErrorCode, message: str, req_id: int = 0, kind: int = 0):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.req_id, self.kind = code, message, req_id, kind


@dataclass
class Decoded:
    kind: Kind
    req_id: int
    body: Msg


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_frame(t: torch.Tensor) -> Any:
    """The tensor's bytes as a buffer zmq can send without copying (contiguous, on CPU)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy()


def as_tensor(obj: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    if obj.dtype == object or obj.dtype.kind in "USVmM":
        raise TypeError(f"numpy dtype {obj.dtype} cannot travel as a tensor frame")
    return torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))


def wire_dtype(name: Any) -> torch.dtype:
    tdtype = _TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if tdtype is None:
        raise WireError(ErrorCode.UNDECODABLE, f"unknown dtype {name!r}")
    return tdtype


def checked_numel(shape: Any) -> int:
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise WireError(ErrorCode.UNDECODABLE, f"bad tensor shape {shape!r}")
    numel = 1
    for s in shape:
        numel *= s
    return numel


def tensor_from_buffer(buf: memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """Zero-copy view of `buf` as a tensor; raises WireError if the sizes disagree."""
    tdtype = wire_dtype(dtype)
    numel = checked_numel(shape)
    if buf.nbytes != numel * tdtype.itemsize:
        raise WireError(ErrorCode.UNDECODABLE,
                        f"tensor frame holds {buf.nbytes} bytes, {dtype}{list(shape)} needs "
                        f"{numel * tdtype.itemsize}")
    if numel == 0:
        return torch.empty(tuple(shape), dtype=tdtype)
    if buf.readonly:
        buf = memoryview(bytearray(buf))
    return torch.frombuffer(buf, dtype=tdtype).reshape(tuple(shape))


class Codec:
    """One per socket owner (not thread-safe: it keeps the frames of the message in progress)."""

    def __init__(self, limits: Limits | None = None, shm: Any = None):
        self.limits = limits or Limits()
        self.shm = shm  # transport.shm.ShmChannel or None
        self._out: list[Any] = []
        self._in: Sequence[Any] = ()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._ext_encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Header, ext_hook=self._ext_hook,
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
        if not isinstance(obj, (torch.Tensor, np.ndarray)):
            raise NotImplementedError(f"cannot encode {type(obj).__name__} on the wire")
        t = as_tensor(obj)
        shape = list(t.shape)
        if self.shm is not None and self.shm.accepts(t):
            ref = self.shm.put(t)
            return msgspec.msgpack.Ext(EXT_SHM, self._ext_encoder.encode([dtype_name(t.dtype), shape, *ref]))
        index = len(self._out)
        self._out.append(tensor_frame(t))
        return msgspec.msgpack.Ext(EXT_TENSOR, self._ext_encoder.encode([dtype_name(t.dtype), shape, index]))

    # -------------------------------------------------------------------------------- decode
    def decode(self, frames: Sequence[Any]) -> Decoded:
        """Decode [header, *tensor_frames]; frames may be zmq.Frame, bytes or memoryviews."""
        if not frames:
            raise WireError(ErrorCode.UNDECODABLE, "empty message")
        if len(frames) - 1 > self.limits.max_frames:
            raise WireError(ErrorCode.TOO_LARGE, f"{len(frames) - 1} frames, limit is "
                            f"{self.limits.max_frames}", *_peek_ids(frames[0]))
        views = [_view(f) for f in frames]
        total = sum(v.nbytes for v in views)
        if total > self.limits.max_message_bytes:
            raise WireError(ErrorCode.TOO_LARGE, f"message of {total} bytes, limit is "
                            f"{self.limits.max_message_bytes}", *_peek_ids(views[0]))
        self._in = views
        try:
            header = self._decoder.decode(views[0])
        except WireError as e:
            e.req_id, e.kind = _peek_ids(views[0])
            raise
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise _classify(views[0], e) from None
        finally:
            self._in = ()
        if header.v != PROTOCOL_VERSION:
            raise WireError(ErrorCode.PROTOCOL_MISMATCH, f"peer speaks protocol {header.v}, this "
                            f"actor speaks {PROTOCOL_VERSION}", header.id, header.kind)
        return Decoded(header.kind, header.id, header.body)

    def _ext_hook(self, code: int, data: memoryview) -> torch.Tensor:
        try:
            meta = msgspec.msgpack.decode(data)
            dtype, shape = meta[0], meta[1]
            if code == EXT_TENSOR:
                index = meta[2]
                if not 0 <= index < len(self._in) - 1:
                    raise WireError(ErrorCode.TRUNCATED, f"tensor frame {index} is missing")
                return tensor_from_buffer(self._in[1 + index], dtype, shape)
            if code == EXT_SHM and self.shm is not None:
                return self.shm.get(dtype, shape, meta[2:])
        except WireError:
            raise
        except (msgspec.DecodeError, LookupError, TypeError, ValueError, RuntimeError,
                OSError) as e:
            raise WireError(ErrorCode.UNDECODABLE, f"bad tensor reference: {e}") from None
        raise WireError(ErrorCode.UNDECODABLE, f"unsupported extension code {code}")

    @staticmethod
    def _dec_hook(tp: type, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if tp is torch.Tensor:
                return obj
            if tp is np.ndarray:
                if obj.dtype == torch.bfloat16 or obj.dtype.is_floating_point and obj.dtype.itemsize == 1:
                    raise ValueError(f"{obj.dtype} has no numpy equivalent; declare the field torch.Tensor")
                return obj.numpy()
        raise NotImplementedError(f"cannot decode {type(obj).__name__} as {tp}")


def _view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer (writable, zero-copy)
    return buf if isinstance(buf, memoryview) else memoryview(buf)


def _peek_ids(header: Any) -> tuple[int, int]:
    """Best-effort (req_id, kind) of a header we could not decode fully, for the error reply."""
    try:
        raw = msgspec.msgpack.decode(_view(header))
        if isinstance(raw, list) and len(raw) >= 3 and all(isinstance(x, int) for x in raw[1:3]):
            return raw[2], raw[1]
    except (msgspec.DecodeError, ValueError):
        pass
    return 0, 0


def _classify(header: memoryview, err: Exception) -> WireError:
    req_id, kind = _peek_ids(header)
    text = str(err)
    try:
        raw = msgspec.msgpack.decode(header)
    except (msgspec.DecodeError, ValueError):
        return WireError(ErrorCode.UNDECODABLE, f"not a message: {text}", req_id, kind)
    if isinstance(raw, list) and raw and raw[0] != PROTOCOL_VERSION:
        return WireError(ErrorCode.PROTOCOL_MISMATCH, f"peer speaks protocol {raw[0]}, this actor "
                         f"speaks {PROTOCOL_VERSION}", req_id, kind)
    if "Invalid value" in text and "$[3].type" in text:
        body = raw[3] if isinstance(raw, list) and len(raw) > 3 else {}
        name = body.get("type") if isinstance(body, dict) else None
        return WireError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {name!r}", req_id, kind)
    return WireError(ErrorCode.UNDECODABLE, f"invalid message: {text}", req_id, kind)
