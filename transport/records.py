"""Schema structs as self-contained msgpack records, numpy arrays inline.

For bytes that are not a message on a socket, where the codec's separate tensor frames have
nowhere to go: the buffer's journal file (`actors/buffer.py`) and the trainer's rank-command
broadcast (`training/ranks.py`). A numpy array (numeric dtype: bool, int, uint, float, complex)
becomes the msgpack extension `EXT_ARRAY` whose payload is the msgpack array
`[dtype, shape, data]`: numpy's `dtype.str` (byte order included, e.g. "<i4"), the shape, and
the raw bytes in C order. Decoded arrays are owned, writable copies (never views of the record).

Invariant: `decoder(T).decode(encoder().encode(x))` gives `x` back with every array's dtype,
shape and values exactly; anything else in an extension (another code, a non-numeric dtype, a
size that disagrees with the shape) is a msgspec.ValidationError, as for any bad value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

EXT_ARRAY = 3  # not one of transport.codec's codes: records and messages never mix, but this
# keeps a record's extension from ever reading as a frame reference
NUMERIC_KINDS = "biufc"  # numpy dtype kinds a record may hold
_META = msgspec.msgpack.Decoder(tuple[str, list[int], memoryview])
_META_ENCODER = msgspec.msgpack.Encoder()


def _enc_hook(obj: Any) -> Any:
    if not isinstance(obj, np.ndarray):
        raise NotImplementedError(f"cannot encode {type(obj).__name__} in a record")
    if obj.dtype.kind not in NUMERIC_KINDS:
        raise TypeError(f"numpy dtype {obj.dtype} cannot go in a record (numeric only)")
    data = np.ascontiguousarray(obj)
    return msgspec.msgpack.Ext(EXT_ARRAY, _META_ENCODER.encode(
        (data.dtype.str, list(data.shape), memoryview(data.reshape(-1).view(np.uint8)))))


def _ext_hook(code: int, payload: memoryview) -> np.ndarray:
    if code != EXT_ARRAY:
        raise ValueError(f"record holds msgpack extension {code}, only arrays ({EXT_ARRAY}) are "
                         f"known")
    dtype_str, shape, data = _META.decode(payload)
    dtype = np.dtype(dtype_str)  # TypeError for a string numpy does not know
    if dtype.kind not in NUMERIC_KINDS or any(s < 0 for s in shape):
        raise ValueError(f"record array of dtype {dtype_str!r} and shape {shape}: numeric dtypes "
                         f"and non-negative sizes only")
    if data.nbytes != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"record array {dtype_str}{shape} needs "
                         f"{dtype.itemsize * int(np.prod(shape))} bytes, holds {data.nbytes}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def encoder() -> msgspec.msgpack.Encoder:
    """An encoder of schema structs (and anything msgspec encodes) with arrays inline."""
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def decoder(typ: Any, fallback: Callable[[type, Any], Any] | None = None
            ) -> msgspec.msgpack.Decoder:
    """A decoder of `encoder()`'s records as `typ`. `fallback(tp, obj)` is asked for a value of a
    custom-typed field (np.ndarray) that is not an array extension, e.g. to read an older
    record format (a TypeError or ValueError it raises is a ValidationError naming the field);
    without it such a value is a ValidationError."""

    def dec_hook(tp: type, obj: Any) -> Any:
        if tp is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        if fallback is not None:
            return fallback(tp, obj)
        raise TypeError(f"expected an array extension, got {type(obj).__name__}")

    def ext_hook(code: int, payload: memoryview) -> np.ndarray:
        try:
            return _ext_hook(code, payload)
        except (msgspec.DecodeError, TypeError, ValueError) as e:
            raise msgspec.ValidationError(f"bad array in record: {e}") from None

    return msgspec.msgpack.Decoder(typ, dec_hook=dec_hook, ext_hook=ext_hook)
