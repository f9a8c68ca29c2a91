"""Codec round trips, zero-copy, limits, typed decode errors, no pickle, and the shared-memory path."""

from __future__ import annotations

import gc
import os
import pickle
import random
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from bench.transport import Blob
from examples.demo import Scale, WorkItem
from transport.codec import (
    EXT_SHM,
    EXT_TENSOR,
    Codec,
    Limits,
    WireError,
    scan_header,
    tensor_frame,
)
from transport.schema import (
    PROTOCOL_VERSION,
    ErrorCode,
    Kind,
    Ping,
    Sample,
    SampleGroup,
    TrainBatch,
)
from transport.shm import PREFIX, SHM_DIR, ShmChannel, ShmConfig

# Every dtype of the brief that this torch build has (float8 variants included where present).
_DTYPE_NAMES = [
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]
DTYPES = [getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)]
assert all(d.itemsize > 0 for d in DTYPES)


def as_zmq_would(frames) -> list[bytearray]:
    """zmq hands the receiver writable buffers: model each frame as its own bytearray."""
    return [bytearray(memoryview(f).cast("B")) if not isinstance(f, bytes) else bytearray(f)
            for f in frames]


def roundtrip(body, enc: Codec | None = None, dec: Codec | None = None, kind=Kind.REQUEST,
              req_id=7):
    enc = enc or Codec()
    frames = enc.encode(kind, req_id, body)
    out = (dec or Codec()).decode(as_zmq_would(frames))
    assert out.kind == kind and out.req_id == req_id
    return out.body


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN payloads, subnormals included) so equality is bit-exact."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(tuple(shape))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert got.is_contiguous()
    assert torch.equal(bits(got), bits(want))


def wire_error(codec: Codec, frames) -> WireError:
    with pytest.raises(WireError) as info:
        codec.decode(frames)
    return info.value


def header_with_ext(code: int, meta: list, req_id: int = 3) -> bytes:
    """A hand-built header whose Blob body holds one tensor extension value."""
    ext = msgspec.msgpack.Ext(code, msgspec.msgpack.encode(meta))
    body = {"type": "Blob", "tensors": {"x": ext}}
    return msgspec.msgpack.encode([PROTOCOL_VERSION, int(Kind.REQUEST), req_id, body])


# ------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_every_dtype_roundtrips_bit_exact(dtype):
    t = random_tensor(dtype, (2, 3, 5), seed=1)
    frames = Codec().encode(Kind.EVENT, 0, Blob(tensors={"x": t}))
    assert len(frames) == 2  # header + one raw frame
    assert len(frames[1]) == t.numel() * dtype.itemsize
    assert len(frames[0]) < 100  # the tensor's bytes are not in the header
    got = Codec().decode(as_zmq_would(frames)).body.tensors["x"]
    assert_bit_equal(got, t)


def test_every_dtype_through_real_zmq_sockets():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://codec-dtypes")
        b.connect("inproc://codec-dtypes")
        enc, dec = Codec(), Codec()
        sent = {str(d): random_tensor(d, (4, 7), seed=i) for i, d in enumerate(DTYPES)}
        a.send_multipart(enc.encode(Kind.EVENT, 0, Blob(tensors=sent)), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        assert len(frames) == 1 + len(DTYPES)
        got = dec.decode(frames).body.tensors
        assert set(got) == set(sent)
        for k, t in sent.items():
            assert_bit_equal(got[k], t)
        # zero-copy from the zmq frame: the tensor views the frame's own buffer
        scale = Scale(tensor=torch.arange(1000, dtype=torch.float32), factor=2.0)
        a.send_multipart(enc.encode(Kind.REQUEST, 11, scale), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        msg = dec.decode(frames)
        assert msg.req_id == 11 and msg.body.factor == 2.0
        assert torch.equal(msg.body.tensor, torch.arange(1000, dtype=torch.float32))
        start = np.frombuffer(frames[1].buffer, np.uint8).ctypes.data
        assert msg.body.tensor.data_ptr() == start
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------------------------ shapes
SHAPES = {
    "scalar": lambda: torch.tensor(3.25),
    "1d": lambda: torch.arange(17, dtype=torch.float32),
    "3d": lambda: torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)),
    "empty": lambda: torch.empty(0, 3),
    "empty_3d": lambda: torch.empty(2, 0, 5, dtype=torch.int64),
    "transposed": lambda: torch.arange(12.).reshape(3, 4).t(),
    "step_slice": lambda: torch.arange(30, dtype=torch.int32)[1::4],
    "expand": lambda: torch.tensor([1.5, -2.0]).expand(3, 2),
    "permuted_3d": lambda: torch.arange(24, dtype=torch.int16).reshape(2, 3, 4).permute(2, 0, 1),
}


@pytest.mark.parametrize("kind", list(SHAPES))
def test_shapes_and_non_contiguous_inputs(kind):
    t = SHAPES[kind]()
    got = roundtrip(Blob(tensors={"x": t})).tensors["x"]
    assert got.shape == t.shape and got.dtype == t.dtype
    assert got.is_contiguous()
    assert torch.equal(got, t)


def test_scalar_through_scale_fields():
    got = roundtrip(Scale(tensor=torch.tensor(-4, dtype=torch.int64), factor=0.5))
    assert got.tensor.dim() == 0 and got.tensor.item() == -4 and got.factor == 0.5


# ------------------------------------------------------------------------------------ numpy
NP_ARRAYS = {
    "int16": np.arange(6, dtype=np.int16).reshape(2, 3),
    "bool": np.array([True, False, True]),
    "float16": np.array([1.5, -0.25, np.inf], dtype=np.float16),
    "float64": np.linspace(0, 1, 7),
    "uint64": np.array([0, 2**64 - 1, 12345], dtype=np.uint64),
    "complex64": np.array([1 + 2j, -3j], dtype=np.complex64),
    "int8_3d": np.arange(-12, 12, dtype=np.int8).reshape(2, 3, 4),
    "empty": np.zeros((0, 2), dtype=np.float32),
    "transposed": np.arange(12, dtype=np.int32).reshape(3, 4).T,
    "reversed": np.arange(10, dtype=np.float32)[::-1],
}


def test_numpy_arrays_in_numpy_fields():
    got = roundtrip(Blob(arrays=NP_ARRAYS)).arrays
    assert set(got) == set(NP_ARRAYS)
    for k, a in NP_ARRAYS.items():
        assert isinstance(got[k], np.ndarray), k
        assert got[k].dtype == a.dtype, k
        assert got[k].shape == a.shape, k
        np.testing.assert_array_equal(got[k], a)


@pytest.mark.parametrize("field", ["arrays", "tensors"])
def test_zero_dim_numpy_array_keeps_its_shape(field):
    a = np.array(7.5, dtype=np.float32)
    got = getattr(roundtrip(Blob(**{field: {"s": a}})), field)["s"]
    assert tuple(got.shape) == ()
    assert float(got) == 7.5


def test_workitem_numpy_field():
    data = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    got = roundtrip(WorkItem(index=3, data=data, produced_at_s=1.5), kind=Kind.EVENT, req_id=0)
    assert got.index == 3 and got.produced_at_s == 1.5
    assert isinstance(got.data, np.ndarray) and got.data.dtype == np.float32
    np.testing.assert_array_equal(got.data, data)


def test_torch_tensors_in_torch_fields_and_numpy_into_torch_field():
    t = torch.randn(3, 3, generator=torch.Generator().manual_seed(2))
    a = np.arange(8, dtype=np.int32).reshape(2, 4)
    got = roundtrip(Blob(tensors={"t": t, "from_numpy": a}))
    assert isinstance(got.tensors["t"], torch.Tensor)
    assert torch.equal(got.tensors["t"], t)
    arrived = got.tensors["from_numpy"]
    assert isinstance(arrived, torch.Tensor)  # a numpy array arrives as torch in a torch field
    assert arrived.dtype == torch.int32 and arrived.shape == (2, 4)
    assert torch.equal(arrived, torch.from_numpy(a))


def test_torch_tensor_into_numpy_field_arrives_as_numpy():
    t = torch.tensor([0, 1, 2, 3, 65535], dtype=torch.uint16)
    got = roundtrip(WorkItem(index=1, data=t, produced_at_s=0.0))
    assert isinstance(got.data, np.ndarray) and got.data.dtype == np.uint16
    np.testing.assert_array_equal(got.data, np.array([0, 1, 2, 3, 65535], dtype=np.uint16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2])
def test_dtype_without_numpy_equivalent_into_numpy_field_is_refused(dtype):
    body = WorkItem(index=1, data=torch.ones(3).to(dtype), produced_at_s=0.0)
    frames = Codec().encode(Kind.REQUEST, 21, body)
    err = wire_error(Codec(), as_zmq_would(frames))
    assert err.code == ErrorCode.UNDECODABLE
    assert err.req_id == 21 and err.kind == Kind.REQUEST
    assert "no numpy equivalent" in err.message and "torch.Tensor" in err.message
    assert "$[3].data" in err.message


def test_object_and_string_numpy_arrays_cannot_travel():
    for a in (np.array(["a", "b"]), np.array([object()], dtype=object)):
        with pytest.raises(TypeError, match="cannot travel"):
            Codec().encode(Kind.EVENT, 0, Blob(arrays={"a": a}))


# ------------------------------------------------------------------------------------ zero-copy
def test_decoded_tensor_views_the_received_frame():
    t = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    frames = as_zmq_would(Codec().encode(Kind.EVENT, 0, Blob(tensors={"x": t})))
    got = Codec().decode(frames).body.tensors["x"]
    start = np.frombuffer(frames[1], np.uint8).ctypes.data
    assert got.data_ptr() == start
    assert start <= got.data_ptr() < start + len(frames[1])
    # and it really is the same memory: writing the frame changes the tensor
    frames[1][0:4] = np.float32(123.0).tobytes()
    assert got[0, 0].item() == 123.0


def test_send_side_frame_is_the_tensor_memory():
    t = torch.arange(256, dtype=torch.float64)  # already contiguous: no copy before zmq
    frames = Codec().encode(Kind.EVENT, 0, Blob(tensors={"x": t}))
    assert np.asarray(frames[1]).ctypes.data == t.data_ptr()


def test_several_tensors_each_get_their_own_frame():
    tensors = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(5)}
    frames = Codec().encode(Kind.EVENT, 0, Blob(tensors=tensors))
    assert len(frames) == 6
    got = Codec().decode(as_zmq_would(frames)).body.tensors
    for k, t in tensors.items():
        assert torch.equal(got[k], t)


# ------------------------------------------------------------------------------------ limits and errors
def test_frame_count_limit():
    body = Blob(tensors={k: torch.ones(2) for k in "abc"})
    frames = as_zmq_would(Codec().encode(Kind.REQUEST, 9, body))
    err = wire_error(Codec(Limits(max_frames=2)), frames)
    assert err.code == ErrorCode.TOO_LARGE and err.req_id == 9 and err.kind == Kind.REQUEST
    assert "3 frames" in err.message
    got = Codec(Limits(max_frames=3)).decode(frames).body.tensors  # exactly at the limit: fine
    assert sorted(got) == ["a", "b", "c"]


def test_byte_limit():
    body = Blob(tensors={"x": torch.ones(512)})  # 2 KiB of tensor data
    frames = as_zmq_would(Codec().encode(Kind.REQUEST, 10, body))
    err = wire_error(Codec(Limits(max_message_bytes=1000)), frames)
    assert err.code == ErrorCode.TOO_LARGE and err.req_id == 10
    total = sum(len(f) for f in frames)
    assert str(total) in err.message and "1000" in err.message
    assert torch.equal(Codec(Limits(max_message_bytes=total)).decode(frames).body.tensors["x"],
                       torch.ones(512))


def test_missing_tensor_frame_is_truncated():
    body = Blob(tensors={"a": torch.ones(4), "b": torch.zeros(4)})
    frames = as_zmq_would(Codec().encode(Kind.REQUEST, 12, body))
    err = wire_error(Codec(), frames[:-1])
    assert err.code == ErrorCode.TRUNCATED and err.req_id == 12 and err.kind == Kind.REQUEST
    err = wire_error(Codec(), frames[:1])
    assert err.code == ErrorCode.TRUNCATED


def test_random_bytes_are_undecodable():
    rng = random.Random(1234)
    codec = Codec()
    for n in (1, 7, 64, 1000):
        for _ in range(20):
            err = wire_error(codec, [bytearray(rng.randbytes(n))])
            assert err.code == ErrorCode.UNDECODABLE and err.req_id == 0, err
    assert wire_error(codec, []).code == ErrorCode.UNDECODABLE
    assert wire_error(codec, [b""]).code == ErrorCode.UNDECODABLE
    # a valid header followed by a garbage tensor frame of the wrong size
    frames = as_zmq_would(codec.encode(Kind.REQUEST, 4, Blob(tensors={"x": torch.ones(4)})))
    frames[1] = frames[1][:-3]
    err = wire_error(codec, frames)
    assert err.code == ErrorCode.UNDECODABLE and err.req_id == 4


def test_unknown_message_type():
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION, 1, 5, {"type": "NoSuchMsg"}])
    err = wire_error(Codec(), [bytearray(frame)])
    assert err.code == ErrorCode.UNKNOWN_MESSAGE
    assert err.req_id == 5 and err.kind == Kind.REQUEST
    assert "NoSuchMsg" in err.message


def test_wrong_protocol_version():
    for v in (PROTOCOL_VERSION + 1, 0):
        frame = msgspec.msgpack.encode([v, 1, 6, {"type": "Ping"}])
        err = wire_error(Codec(), [bytearray(frame)])
        assert err.code == ErrorCode.PROTOCOL_MISMATCH and err.req_id == 6
        assert f"protocol {v}" in err.message
    # an unknown type from a different version is still reported as the version problem
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, 1, 6, {"type": "FutureMsg"}])
    assert wire_error(Codec(), [frame]).code == ErrorCode.PROTOCOL_MISMATCH


def test_bad_tensor_references_are_wire_errors():
    codec = Codec()
    cases = [
        (header_with_ext(EXT_TENSOR, ["nosuch_dtype", [2], 0]), [bytearray(8)]),
        (header_with_ext(EXT_TENSOR, ["float32", [2]]), [bytearray(8)]),  # no frame index
        (header_with_ext(EXT_TENSOR, ["float32", [3], 0]), [bytearray(8)]),  # size mismatch
        (header_with_ext(9, ["float32", [2], 0]), [bytearray(8)]),  # unknown extension code
        (header_with_ext(EXT_SHM, ["float32", [2], "rlx-x", 8]), []),  # shm with no channel
    ]
    for head, rest in cases:
        err = wire_error(codec, [bytearray(head), *rest])
        assert err.code == ErrorCode.UNDECODABLE and err.req_id == 3, err


@pytest.mark.parametrize("case", ["negative_shape", "shm_missing_segment", "shm_bad_dtype",
                                  "shm_shape_mismatch"])
def test_malformed_tensor_reference_is_always_a_wire_error(case):
    sender = ShmChannel(ShmConfig(min_bytes=1024))
    receiver = ShmChannel(ShmConfig(min_bytes=1024))
    try:
        if case == "negative_shape":  # numel (-1 * -4) matches the 16-byte frame
            frames = [header_with_ext(EXT_TENSOR, ["float32", [-1, -4], 0]), bytearray(16)]
        else:
            name, nbytes = sender.put(tensor_frame(torch.ones(1024)))
            ref = {
                "shm_missing_segment": ["float32", [4], PREFIX + "no-such-segment", 16],
                "shm_bad_dtype": ["nosuch_dtype", [1024], name, nbytes],
                "shm_shape_mismatch": ["float32", [5], name, nbytes],
            }[case]
            frames = [header_with_ext(EXT_SHM, ref)]
        # keep no exception object: its traceback would pin the segment's mapping (an fd)
        got = escaped = None
        try:
            Codec(shm=receiver).decode(frames)
        except WireError as e:
            got = (e.code, e.req_id)
        except Exception as e:  # noqa: BLE001 - the bug: anything but WireError escapes
            escaped = repr(e)
        assert escaped is None, f"decode raised {escaped} instead of WireError"
        assert got == (ErrorCode.UNDECODABLE, 3)
    finally:
        sender.close()
        receiver.close()
        gc.collect()


def test_conjugate_view_tensor_roundtrips():
    t = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    got = roundtrip(Blob(tensors={"x": t})).tensors["x"]
    assert torch.equal(got, torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))


# ------------------------------------------------------------------------------------ no pickle
class _Custom:
    pass


class _Tripwire:
    fired = False

    def __reduce__(self):
        return (_trip, ())


def _trip():
    _Tripwire.fired = True
    return "unpickled!"


def test_arbitrary_python_objects_are_not_encoded():
    codec = Codec()
    for obj in (_Custom(), object(), lambda: 1):
        with pytest.raises((NotImplementedError, TypeError), match="cannot encode"):
            codec.encode(Kind.REQUEST, 1, Blob(payload=obj))
    with pytest.raises((NotImplementedError, TypeError)):
        codec.encode(Kind.REQUEST, 1, Blob(tensors={"x": _Custom()}))
    # after a failed encode the codec is clean: the next message has no stray frames
    frames = codec.encode(Kind.REQUEST, 2, Blob(tensors={"y": torch.ones(2)}))
    assert len(frames) == 2


def test_a_set_is_never_pickled_and_is_refused_by_the_typed_receiver():
    # msgspec encodes a set natively as a msgpack array (no pickle); the bytes-typed field on the
    # receiving side refuses it with a typed error instead of producing a set.
    frames = Codec().encode(Kind.REQUEST, 8, Blob(payload={1, 2}))
    assert b"\x80\x04" not in frames[0] and b"builtins" not in frames[0]  # no pickle stream
    err = wire_error(Codec(), as_zmq_would(frames))
    assert err.code == ErrorCode.UNDECODABLE and err.req_id == 8
    assert "payload" in err.message


def test_pickled_payload_stays_bytes():
    payload = pickle.dumps(_Tripwire())
    got = roundtrip(Blob(payload=payload))
    assert isinstance(got.payload, bytes) and got.payload == payload
    assert _Tripwire.fired is False
    got = roundtrip(Ping(payload=payload))
    assert got.payload == payload and _Tripwire.fired is False


# ------------------------------------------------------------------------------------ shared memory
def _shm_files(ch: ShmChannel) -> list[str]:
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(ch._tag))


@pytest.fixture
def shm_pair():
    sender = ShmChannel(ShmConfig(min_bytes=1024))
    receiver = ShmChannel(ShmConfig(min_bytes=1024))
    assert sender.enabled and receiver.enabled
    yield sender, receiver
    sender.close()
    receiver.close()
    gc.collect()  # mappings referenced only from finished exceptions' tracebacks
    assert _shm_files(sender) == [] and _shm_files(receiver) == []


def test_shm_path_sends_only_a_header_and_reconstructs(shm_pair):
    sender, receiver = shm_pair
    enc, dec = Codec(shm=sender), Codec(shm=receiver)
    t = torch.randn(256 * 1024, generator=torch.Generator().manual_seed(5))  # 1 MiB
    frames = enc.encode(Kind.EVENT, 0, Blob(tensors={"x": t}))
    assert len(frames) == 1 and len(frames[0]) < 200  # only the header
    assert len(sender._own) == 1 and len(_shm_files(sender)) == 1
    got = dec.decode(as_zmq_would(frames)).body.tensors["x"]
    assert_bit_equal(got, t)
    seg = sender._own[0]
    # zero copy on receive: the tensor views the mapped segment, after the 64-byte header
    mapped = receiver._mapped[seg.name]
    assert got.data_ptr() == np.frombuffer(mapped, np.uint8).ctypes.data + 64
    # other dtypes and shapes travel the same way
    b = random_tensor(torch.bfloat16, (512, 1024), seed=6)
    frames = enc.encode(Kind.EVENT, 0, Blob(tensors={"b": b}))
    assert len(frames) == 1
    assert_bit_equal(dec.decode(as_zmq_would(frames)).body.tensors["b"], b)
    del got, mapped


def test_shm_segment_is_reused_after_the_receiver_drops_the_tensor(shm_pair):
    sender, receiver = shm_pair
    enc, dec = Codec(shm=sender), Codec(shm=receiver)
    t1 = torch.full((256 * 1024,), 1.0)
    got = dec.decode(as_zmq_would(enc.encode(Kind.EVENT, 0, Blob(tensors={"x": t1}))))
    x = got.body.tensors["x"]
    assert torch.equal(x, t1)
    assert sender._own[0].state() != 0  # busy while the receiver holds it
    del got, x
    gc.collect()
    assert sender._own[0].state() == 0  # released by the receiver's finalizer
    t2 = torch.full((256 * 1024,), 2.0)
    y = dec.decode(as_zmq_would(enc.encode(Kind.EVENT, 0, Blob(tensors={"x": t2})))).body
    assert len(sender._own) == 1  # the same segment was reused
    assert torch.equal(y.tensors["x"], t2)
    assert len(_shm_files(sender)) == 1


def test_shm_held_tensor_is_never_overwritten(shm_pair):
    sender, receiver = shm_pair
    enc, dec = Codec(shm=sender), Codec(shm=receiver)
    t1 = torch.full((256 * 1024,), 1.0)
    t2 = torch.full((256 * 1024,), 2.0)
    x = dec.decode(as_zmq_would(enc.encode(Kind.EVENT, 0, Blob(tensors={"x": t1})))).body
    gc.collect()
    y = dec.decode(as_zmq_would(enc.encode(Kind.EVENT, 0, Blob(tensors={"x": t2})))).body
    assert len(sender._own) == 2  # a second segment, the first one is still in use
    assert len(_shm_files(sender)) == 2
    assert torch.equal(x.tensors["x"], t1)  # first tensor unchanged
    assert torch.equal(y.tensors["x"], t2)
    # a slice keeps the segment busy too
    part = x.tensors["x"][:10]
    del x
    gc.collect()
    assert sender._own[0].state() != 0
    z = dec.decode(as_zmq_would(enc.encode(Kind.EVENT, 0, Blob(tensors={"x": t2 * 3})))).body
    assert len(sender._own) == 3
    assert torch.equal(part, torch.ones(10))
    assert torch.equal(z.tensors["x"], t2 * 3)


def test_shm_pool_budget_falls_back_to_frames():
    sender = ShmChannel(ShmConfig(min_bytes=1024, max_pool_bytes=1 << 20))
    receiver = ShmChannel(ShmConfig(min_bytes=1024))
    try:
        enc, dec = Codec(shm=sender), Codec(shm=receiver)
        big = torch.arange(2 * 256 * 1024, dtype=torch.float32)  # 2 MiB > pool budget
        assert sender.accepts(big.numel() * 4) is False
        frames = enc.encode(Kind.EVENT, 0, Blob(tensors={"x": big}))
        assert len(frames) == 2 and len(sender._own) == 0
        assert torch.equal(dec.decode(as_zmq_would(frames)).body.tensors["x"], big)
        # fill the budget with one held tensor; the next one travels as a frame, nothing blocks
        one = torch.full((256 * 1024,), 4.0)
        held = dec.decode(as_zmq_would(enc.encode(Kind.EVENT, 0, Blob(tensors={"x": one}))))
        assert len(sender._own) == 1
        assert sender.accepts(one.numel() * 4) is False
        frames = enc.encode(Kind.EVENT, 0, Blob(tensors={"x": one * 2}))
        assert len(frames) == 2 and len(sender._own) == 1
        assert torch.equal(dec.decode(as_zmq_would(frames)).body.tensors["x"], one * 2)
        assert torch.equal(held.body.tensors["x"], one)
        # small tensors never take the shm path
        assert sender.accepts(torch.ones(8).numel() * 4) is False
        del held
    finally:
        sender.close()
        receiver.close()
    assert _shm_files(sender) == []


def test_shm_refuses_foreign_segment_names(shm_pair):
    _, receiver = shm_pair
    for name in ("foo", "/etc/passwd", f"{PREFIX}../../etc/passwd", "dev-shm-other", 42):
        with pytest.raises(ValueError, match="refusing"):
            receiver.get("float32", [4], [name, 16])
        frames = [header_with_ext(EXT_SHM, ["float32", [4], name, 16])]
        err = wire_error(Codec(shm=receiver), frames)
        assert err.code == ErrorCode.UNDECODABLE and "refusing" in err.message
    assert receiver._mapped == {}


def test_shm_reference_larger_than_segment_is_refused(shm_pair):
    sender, receiver = shm_pair
    name, _ = sender.put(tensor_frame(torch.ones(1024)))
    frames = [header_with_ext(EXT_SHM, ["float32", [1 << 28], name, 1 << 30])]
    err = wire_error(Codec(shm=receiver), frames)
    assert err.code == ErrorCode.UNDECODABLE


def test_shm_close_unlinks_segments():
    sender = ShmChannel(ShmConfig(min_bytes=1024))
    receiver = ShmChannel(ShmConfig(min_bytes=1024))
    enc, dec = Codec(shm=sender), Codec(shm=receiver)
    x = dec.decode(as_zmq_would(enc.encode(Kind.EVENT, 0, Blob(tensors={
        "a": torch.ones(256 * 1024), "b": torch.zeros(300 * 1024)})))).body
    assert len(_shm_files(sender)) == 2
    sender.close()
    receiver.close()
    assert _shm_files(sender) == []
    # the receiver's tensors stay valid after the files are unlinked
    assert torch.equal(x.tensors["a"], torch.ones(256 * 1024))
    assert torch.equal(x.tensors["b"], torch.zeros(300 * 1024))


# ------------------------------------------------------------------------------------ hostile headers
def nested(depth: int, inner: bytes = b"\xc0") -> bytes:
    """`depth` one-element arrays around `inner` (1 byte per level)."""
    return b"\x91" * depth + inner


def array32(count: int, item: bytes) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big") + item * count


def body_field(type_name: str, field: str, value: bytes, req_id: int = 9) -> bytes:
    """A REQUEST header whose body has one field with hand-made msgpack bytes."""
    enc = msgspec.msgpack.encode
    return b"".join([b"\x94", enc(PROTOCOL_VERSION), enc(int(Kind.REQUEST)), enc(req_id),
                     b"\x82", enc("type"), enc(type_name), enc(field), value])


def test_deeply_nested_header_is_a_wire_error_not_a_recursion_error():
    """Failure 8: 2,000 nested arrays (a 2 KB frame) raised RecursionError in the untyped peek."""
    for frame in (nested(2000), bytes([0x94, PROTOCOL_VERSION, 1, 5]) + nested(2000),
                  body_field("Blob", "payload", nested(100_000))):
        err = wire_error(Codec(), [bytearray(frame)])
        assert err.code in (ErrorCode.TOO_LARGE, ErrorCode.UNDECODABLE), err
    err = wire_error(Codec(), [body_field("Blob", "payload", nested(2000), req_id=21)])
    assert err.code == ErrorCode.TOO_LARGE and "max_depth" in err.message
    assert (err.req_id, err.kind) == (21, Kind.REQUEST)  # still attributable: answered
    # exactly at the limit is scanned fine (and then refused by the typed decode)
    limits = Limits(max_depth=5)
    assert wire_error(Codec(limits), [body_field("Blob", "payload", nested(3))]).code == \
        ErrorCode.UNDECODABLE
    assert wire_error(Codec(limits), [body_field("Blob", "payload", nested(4))]).code == \
        ErrorCode.TOO_LARGE


def test_huge_header_of_empty_maps_is_refused_fast_and_small():
    """Failure 9: an 8-32 MiB array of empty maps blocked the loop for 6-27 s and took 2.6 GiB."""
    import psutil

    proc = psutil.Process()
    n = 16 << 20
    mixed = b"\xdd" + (n // 6).to_bytes(4, "big") + b"\x80\xcc\x00" * (n // 12)
    # budgets far below the 6-27 s of the failure, in this process's CPU time (a loaded
    # machine stretches the wall-clock time, not the work; unloaded: 0.1-2 ms for the uniform
    # arrays, ~0.5 s for the mixed one)
    cases = [(array32(n, b"\x80"), 3.0),
             (body_field("SampleGroup", "samples", array32(n, b"\x80")), 3.0),
             (body_field("SampleGroup", "samples", b"\x94" + array32(n // 4, b"\x80") * 4), 3.0),
             # leaves of mixed sizes are walked one by one: max_header_items bounds the walk
             # (the empty maps are objects; the numbers between them have their own limit)
             (body_field("SampleGroup", "samples", b"\x94" + mixed * 4), 5.0)]
    for frame, budget_s in cases:
        assert len(frame) >= n
        rss, t0 = proc.memory_info().rss, time.process_time()
        err = wire_error(Codec(), [frame])
        elapsed = time.process_time() - t0
        assert err.code == ErrorCode.TOO_LARGE, err
        assert elapsed < budget_s, f"{err.message}: {elapsed:.2f} s of CPU"
        assert proc.memory_info().rss - rss < 100 << 20


def test_millions_of_tiny_containers_are_refused_fast_and_small():
    """Arrays, maps and strings are what make a small header costly (a walk step each, and an
    object of ~60 bytes or more once decoded): millions of tiny ones are refused by
    max_header_items before anything is built; alike rows at C speed, others walked."""
    import psutil

    proc = psutil.Process()
    rows = 4 << 20
    # 4 values, 7 objects: [0], [0, 128], [[nil]], {"a": []}
    mixed = b"\x91\x00" + b"\x92\x00\xcc\x80" + b"\x91\x91\xc0" + b"\x81\xa1a\x90"
    # budgets with room for a loaded 2-core machine (there: ~0.06 s for the alike rows, which
    # the old walk took ~5 s to refuse; ~2 s for the mixed ones, walked up to the limit)
    cases = [(body_field("Sample", "teacher_topk_ids", array32(rows, b"\x91\x00")), 1.0),
             (body_field("Sample", "teacher_topk_logprobs",
                         b"\x94" + array32(rows // 4, b"\x92\xcb" + bytes(8) + b"\x01") * 4), 1.0),
             (body_field("SampleGroup", "samples",
                         b"\xdd" + rows.to_bytes(4, "big") + mixed * (rows // 4)), 6.0)]
    for frame, budget_s in cases:
        rss, t0 = proc.memory_info().rss, time.process_time()
        err = wire_error(Codec(), [frame])
        elapsed = time.process_time() - t0
        assert err.code == ErrorCode.TOO_LARGE and "limits.max_header_items" in err.message, err
        assert f"more than {Limits().max_header_items} arrays, maps" in err.message
        assert elapsed < budget_s, f"{err.message}: {elapsed:.2f} s of CPU"
        assert proc.memory_info().rss - rss < 100 << 20
    # the same rows under the limit are accepted: the limit, not the shape, refused them
    # (1000 rows, their array, the body map, the header array and 3 strings)
    ok = body_field("Sample", "teacher_topk_ids", array32(1000, b"\x91\x00"))
    scan_header(memoryview(ok), Limits(max_header_items=1006))
    assert "max_header_items" in wire_error(Codec(Limits(max_header_items=1005)), [ok]).message


def test_numbers_have_their_own_limit():
    """Ints, floats, bools and nils count against max_header_numbers, never max_header_items:
    300k token ids and log-probs fit a limit of 40 objects."""
    ids = list(range(0, 400_000, 4))  # every msgpack int width: fixint, uint8, uint16, uint32
    sample = Sample(group_id="g", index=1, domain="d", prompt_ids=[], response_ids=ids,
                    loss_mask=[1] * len(ids), rollout_logprobs=[-0.5 - i for i in range(len(ids))])
    frames = Codec().encode(Kind.EVENT, 0, SampleGroup(samples=[sample]))
    numbers = 3 + 1 + 3 * len(ids)  # version, kind, id; index; the three lists
    got = Codec(Limits(max_header_items=40, max_header_numbers=numbers)).decode(frames).body
    assert got.samples[0].response_ids == ids and got.samples[0].rollout_logprobs[-1] == -99_999.5
    err = wire_error(Codec(Limits(max_header_numbers=numbers - 1)), frames)
    assert err.code == ErrorCode.TOO_LARGE
    assert err.message == \
        f"header holds more than {numbers - 1} numbers (limits.max_header_numbers)"
    assert "max_header_items" in wire_error(Codec(Limits(max_header_items=15)), frames).message


def topk_batch(samples: int, tokens: int, k: int, prompt: int, vocab: int = 151_936) -> TrainBatch:
    """A TrainBatch of on-policy distillation with teacher top-k signals, as the buffer sends
    it to the trainer: [tokens, k] int32 token ids of a Qwen-sized vocabulary and sorted
    float32 log-probs per sample."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(samples):
        ids = rng.integers(0, vocab, size=(tokens, k)).astype(np.int32)
        logprobs = (-np.sort(rng.exponential(2.0, size=(tokens, k)), axis=1)).astype(np.float32)
        out.append(Sample(group_id=f"g{i // 8}", index=i % 8, domain="math",
                          prompt_ids=rng.integers(0, vocab, prompt).tolist(),
                          response_ids=ids[:, 0].tolist(), loss_mask=[1] * tokens,
                          rollout_logprobs=logprobs[:, 0].tolist(), reward=1.0, weight_version=3,
                          teacher="math-teacher", teacher_logprobs=logprobs[:, 1].tolist(),
                          teacher_topk_ids=ids, teacher_topk_logprobs=logprobs))
    return TrainBatch(step=7, samples=out, counters={"groups": samples // 8})


def assert_same_topk(got: Sample, want: Sample) -> None:
    """dtype, shape and every bit of both top-k arrays."""
    for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name


def test_big_topk_train_batch_travels_as_frames_not_header_numbers():
    """64 samples x 4096 response tokens x top-20: the top-k arrays go as 128 raw frames (40
    MiB), so the header holds only the per-token lists (it held 73 MiB of 11 Mi numbers and
    0.5 Mi rows when top-k were nested lists), and come back bit for bit, dtype and shape."""
    samples, tokens, k, prompt = 64, 4096, 20, 512
    batch = topk_batch(samples, tokens, k, prompt)
    frames = Codec().encode(Kind.REPLY, 5, batch)
    assert len(frames) == 1 + 2 * samples
    assert sum(memoryview(f).nbytes for f in frames[1:]) == samples * tokens * k * (4 + 4)
    assert len(frames[0]) < 8 << 20
    got = Codec().decode(as_zmq_would(frames))
    assert got.req_id == 5 and isinstance(got.body, TrainBatch)
    for a, b in zip(got.body.samples, batch.samples, strict=True):
        assert_same_topk(a, b)
        assert a.response_ids == b.response_ids and a.teacher_logprobs == b.teacher_logprobs
    again = Codec().encode(Kind.REPLY, 5, got.body)  # every value came back
    assert again[0] == frames[0] and all(bytes(x) == bytes(y) for x, y in zip(again, frames))
    del got, batch
    # top-k count against neither header limit now: the lists and a few scalars per sample,
    # ~20 objects per sample (two of them the top-k extensions); one number less is refused
    numbers = samples * (prompt + 4 * tokens)
    scan_header(memoryview(frames[0]), Limits(max_header_numbers=numbers + 8 * samples,
                                              max_header_items=32 * samples))
    err = wire_error(Codec(Limits(max_header_numbers=numbers - 1)), frames)
    assert err.code == ErrorCode.TOO_LARGE and "max_header_numbers" in err.message


def topk_sample(ids: np.ndarray | None, logprobs: np.ndarray | None, n: int = 0) -> Sample:
    n = n if ids is None else len(ids)
    return Sample(group_id="g", index=0, domain="math", prompt_ids=[1], response_ids=[2] * n,
                  loss_mask=[1] * n, rollout_logprobs=[-1.0] * n, teacher="t",
                  teacher_topk_ids=ids, teacher_topk_logprobs=logprobs)


def test_topk_arrays_round_trip_exactly_and_absent_ones_stay_absent():
    ids = np.array([[7, 0, 2**31 - 1], [5, 4, 3]], dtype=np.int32)
    lps = np.array([[-0.0, -1e-30, -3.4e38], [np.nextafter(np.float32(-1), 0), -2.5, -88.7]],
                   dtype=np.float32)
    plain = topk_sample(None, None, n=2)  # no top-k: nothing on the wire for it, None back
    got = roundtrip(SampleGroup(samples=[topk_sample(ids, lps), topk_sample(ids[:0], lps[:0]),
                                         plain]))
    assert_same_topk(got.samples[0], topk_sample(ids, lps))
    assert got.samples[0].teacher_topk_logprobs[0, 0].tobytes() == np.float32(-0.0).tobytes()
    assert_same_topk(got.samples[1], topk_sample(ids[:0], lps[:0]))  # [0, 3]: no response yet
    assert got.samples[2].teacher_topk_ids is None and got.samples[2].teacher_topk_logprobs is None
    assert b"teacher_topk" not in Codec().encode(Kind.EVENT, 0, plain)[0]


def test_a_peer_of_the_list_protocol_is_refused_by_version():
    """Protocol 1 sent top-k as rows of numbers in the header: a peer still speaking it gets
    PROTOCOL_MISMATCH (checked before anything is decoded), not a confusing type error; the
    same rows under this protocol's version are a typed decode error."""
    assert PROTOCOL_VERSION == 2
    sample = {"type": "Sample", "group_id": "g", "index": 0, "domain": "d", "prompt_ids": [1],
              "response_ids": [2], "loss_mask": [1], "rollout_logprobs": [-1.0],
              "teacher_topk_ids": [[3, 4]], "teacher_topk_logprobs": [[-0.1, -2.0]]}
    for v, code, message in [(1, ErrorCode.PROTOCOL_MISMATCH,
                              "peer speaks protocol 1, this actor speaks 2"),
                             (2, ErrorCode.UNDECODABLE, "cannot decode list")]:
        frame = msgspec.msgpack.encode([v, int(Kind.EVENT), 0,
                                        {"type": "SampleGroup", "samples": [sample]}])
        err = wire_error(Codec(), [frame])
        assert err.code == code and message in err.message, err


def random_value(rng: random.Random, depth: int = 0):
    """Random msgpack-able data shaped like headers: scalars of every width, strings, bytes,
    extensions, rows of numbers alike or not, runs of same-size leaves, nesting, maps."""
    if depth > 3 or rng.random() < 0.4:
        return rng.choice([
            lambda: rng.randint(-40, 200), lambda: rng.randint(-2**63, 2**64 - 1),
            lambda: rng.choice([127, 128, 255, 256, 65535, 65536, 2**32, -32, -33, -129]),
            lambda: rng.random(), lambda: None, lambda: rng.random() < 0.5,
            lambda: "x" * rng.choice([0, 1, 31, 32, 300]), lambda: b"y" * rng.choice([0, 300]),
            lambda: msgspec.msgpack.Ext(5, b"z" * rng.choice([1, 2, 3, 4, 8, 16, 300]))])()
    shape = rng.random()
    if shape < 0.25:  # rows of numbers, as top-k signals
        make = rng.choice([rng.random, lambda: rng.randint(0, 127), lambda: rng.randint(0, 2**17)])
        k = rng.choice([1, 2, 15, 16, 20, 31, 32])
        return [[make() for _ in range(k)] for _ in range(rng.choice([1, 31, 32, 40]))]
    if shape < 0.4:  # runs of one value size, numbers or not
        make = rng.choice([rng.random, lambda: 3, dict, list, lambda: "ab"])
        return [make() for _ in range(rng.choice([0, 1, 31, 32, 33, 70]))]
    if shape < 0.75:
        return [random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 3, 15, 16]))]
    return {rng.choice(["a", "bb", 1, 2.5]) if rng.random() < 0.3 else f"k{i}":
            random_value(rng, depth + 1) for i in range(rng.choice([0, 1, 2, 16]))}


def reference_counts(value, depth: int = 1) -> tuple[int, int, int]:
    """(numbers, objects, nesting depth of non-empty containers) of Python data, by recursion."""
    if value is None or isinstance(value, (bool, int, float)):
        return 1, 0, 0
    if not isinstance(value, (list, dict)):
        return 0, 1, 0
    children = [x for kv in value.items() for x in kv] if isinstance(value, dict) else value
    numbers, objects, deepest = 0, 1, depth if value else 0
    for child in children:
        n, o, d = reference_counts(child, depth + 1)
        numbers, objects, deepest = numbers + n, objects + o, max(deepest, d)
    return numbers, objects, deepest


_REF_NUMBER = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
               0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}  # first byte -> bytes after it
_REF_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}  # bin, str: length bytes
_REF_EXT = {0xc7: 1, 0xc8: 2, 0xc9: 4}  # ext: length bytes (then a type byte)


def reference_scan(frame: bytes) -> tuple[int, int, int]:
    """(numbers, objects, nesting depth) of the one msgpack value that `frame` must be, read
    byte by byte with recursion, straight from the msgpack spec; ValueError if it is not."""
    def read(p: int, n: int) -> int:
        if p + n > len(frame):
            raise ValueError("truncated")
        return int.from_bytes(frame[p:p + n], "big")

    def value(p: int, depth: int) -> tuple[int, int, int, int]:  # end, numbers, objects, depth
        b = read(p, 1)
        if b < 0x80 or b >= 0xe0 or b in _REF_NUMBER:
            end = p + 1 + _REF_NUMBER.get(b, 0)
            read(p + 1, end - p - 1)
            return end, 1, 0, 0
        if 0xa0 <= b <= 0xbf or b in _REF_SIZED or b in _REF_EXT or 0xd4 <= b <= 0xd8:
            if 0xa0 <= b <= 0xbf:
                start, length = p + 1, b & 0x1f
            elif 0xd4 <= b <= 0xd8:
                start, length = p + 2, 1 << (b - 0xd4)
            else:
                width = _REF_SIZED.get(b) or _REF_EXT[b]
                start, length = p + 1 + width + (b in _REF_EXT), read(p + 1, width)
            read(start, length)
            return start + length, 0, 1, 0
        if 0x80 <= b <= 0x9f:
            count, p, per = b & 0x0f, p + 1, 2 if b < 0x90 else 1
        elif b in (0xdc, 0xdd, 0xde, 0xdf):
            width = 2 if b in (0xdc, 0xde) else 4
            count, p, per = read(p + 1, width), p + 1 + width, 2 if b >= 0xde else 1
        else:
            raise ValueError(f"0x{b:02x} starts no value")
        numbers, objects, deepest = 0, 1, depth if count else 0
        for _ in range(count * per):
            p, n, o, d = value(p, depth + 1)
            numbers, objects, deepest = numbers + n, objects + o, max(deepest, d)
        return p, numbers, objects, deepest

    end, numbers, objects, depth = value(0, 1)
    if end != len(frame):
        raise ValueError("trailing bytes")
    return numbers, objects, depth


def test_scan_counts_agree_with_a_reference_on_random_headers():
    """The scan's shortcuts (same-size runs, alike rows, short rows walked in place) count
    exactly what a plain recursive reading of the msgpack spec counts, at every limit, on
    random frames and on corrupted ones; a frame the reference cannot read is undecodable."""
    rng = random.Random(7)
    roomy = {"max_header_numbers": 1 << 30, "max_header_items": 1 << 30, "max_depth": 64,
             "max_container_len": 1 << 30}

    def refusal(frame: bytes, **limits) -> str:
        try:
            scan_header(memoryview(frame), Limits(**{**roomy, **limits}))
        except WireError as e:
            return e.message
        return ""

    def check(frame: bytes, counts: tuple[int, int, int]) -> None:
        numbers, objects, depth = counts
        assert refusal(frame, max_header_numbers=max(numbers, 1),
                       max_header_items=max(objects, 1), max_depth=max(depth, 1)) == ""
        if numbers > 1:
            assert "max_header_numbers" in refusal(frame, max_header_numbers=numbers - 1)
        if objects > 1:
            assert "max_header_items" in refusal(frame, max_header_items=objects - 1)
        if depth > 1:
            assert "max_depth" in refusal(frame, max_depth=depth - 1)

    # [5000 zero bytes, value]: over 4 KiB, so that every frame is walked (a smaller one that
    # fits every limit by its size is left to the typed decode)
    head = b"\x92" + msgspec.msgpack.encode(bytes(5000))
    readable = unreadable = 0
    for _ in range(400):
        value = random_value(rng)
        encoded = msgspec.msgpack.encode(value)
        assert reference_scan(encoded) == reference_counts(value)
        check(head + encoded, reference_scan(head + encoded))
        for _ in range(4):
            broken = bytearray(head + encoded)
            at = rng.randrange(len(head), len(broken))
            if rng.random() < 0.6:
                broken[at] = rng.randrange(256)
            else:
                del broken[at:]
            try:
                counts = reference_scan(bytes(broken))
            except ValueError:
                with pytest.raises(WireError) as err:
                    scan_header(memoryview(bytes(broken)), Limits(**roomy))
                assert err.value.code == ErrorCode.UNDECODABLE, err.value
                unreadable += 1
            else:
                check(bytes(broken), counts)
                readable += 1
    assert readable > 100 and unreadable > 100  # both kinds of corruption were checked


def test_header_limits_are_checked_before_decoding():
    blob = Codec().encode(Kind.REQUEST, 5, Blob(payload=bytes(1000)))
    err = wire_error(Codec(Limits(max_header_bytes=999)), blob)
    assert err.code == ErrorCode.TOO_LARGE and "max_header_bytes" in err.message
    assert err.req_id == 5
    assert Codec(Limits(max_header_bytes=len(blob[0]))).decode(blob).body.payload == bytes(1000)
    tokens = Codec().encode(Kind.EVENT, 0, Blob(arrays={"a": np.ones(3)}, tensors={
        f"t{i}": torch.ones(1) for i in range(3)}))
    for limits, name in [(Limits(max_container_len=2), "max_container_len"),
                         (Limits(max_header_items=15), "max_header_items")]:
        err = wire_error(Codec(limits), tokens)
        assert err.code == ErrorCode.TOO_LARGE and name in err.message
    assert len(Codec(Limits(max_container_len=4)).decode(tokens).body.tensors) == 3
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        Limits(max_depth=0)


def test_declared_lengths_past_the_end_and_trailing_bytes_are_undecodable():
    ping = msgspec.msgpack.encode([PROTOCOL_VERSION, 1, 4, {"type": "Ping"}])
    for frame in (b"\xdd\xff\xff\xff\xff\x00", b"\xdb\xff\xff\xff\xff", ping + b"\x00",
                  ping[:-1], b"\xc1", body_field("Blob", "payload", b"\xc6\xff\xff\xff\xff")):
        assert wire_error(Codec(), [frame]).code == ErrorCode.UNDECODABLE, frame[:8]
    assert wire_error(Codec(), [ping[:-1]]).req_id == 4


def test_deeply_nested_tensor_reference_is_typed():
    """Extension payloads are decoded typed, so a nested or huge one is refused, not built."""
    ext = msgspec.msgpack.Ext(EXT_TENSOR, nested(5000))
    head = msgspec.msgpack.encode([PROTOCOL_VERSION, 1, 3, {"type": "Blob", "tensors": {"x": ext}}])
    err = wire_error(Codec(), [head, bytes(8)])
    assert err.code == ErrorCode.UNDECODABLE and err.req_id == 3


def test_user_messages_are_registered_on_the_wire_and_tags_cannot_collide():
    from transport.schema import Msg, register_messages

    class Tally(Msg):
        count: int

    before = Codec()  # made before the type was registered: it cannot decode it
    frames = before.encode(Kind.EVENT, 0, Tally(count=3))
    with pytest.raises(WireError):
        before.decode(frames)
    register_messages(Tally)
    register_messages(Tally)  # the same type again is fine
    got = Codec().decode(as_zmq_would(Codec().encode(Kind.EVENT, 0, Tally(count=3))))
    assert got.body == Tally(count=3)

    class Ping(Msg):  # the tag of a project message
        x: int = 0

    with pytest.raises(ValueError, match="message tag 'Ping' is taken"):
        register_messages(Ping)

    class Other(Msg, tag="Tally"):
        pass

    with pytest.raises(ValueError, match="'Tally' is taken"):
        register_messages(Other)
    with pytest.raises(TypeError, match="not a subclass of transport.schema.Msg"):
        register_messages(int)
