"""The wire schema: every message any actor sends is a struct defined here.

Invariant: nothing else builds wire dicts by hand. A message on the wire is one msgpack *header*
frame (`Header`: protocol version, kind, request id, body) followed by
zero or more raw tensor frames; tensors inside a body are msgpack extension values that point at
those frames (see `transport.codec`). Request/reply pairs are named alike (`Ping` / `Pong`,
`Shutdown` / `ShutdownReply`). Bump `PROTOCOL_VERSION` on any incompatible change; it is checked at
the HELLO/WELCOME handshake and stamped on every header.
"""

from __future__ import annotations

import enum
import functools
import sys
import typing
from typing import TYPE_CHECKING, Union

import msgspec
import numpy as np

if TYPE_CHECKING:
    from torch import Tensor
else:
    class _TensorType(type):
        def __instancecheck__(cls, obj: object) -> bool:
            torch = sys.modules.get("torch")
            return torch is not None and isinstance(obj, torch.Tensor)

    class Tensor(metaclass=_TensorType):
        """A field's type: decoded as a torch.Tensor (torch imported then, not with this module;
        fields of numpy arrays are `np.ndarray`); `isinstance(t, Tensor)` for torch tensors."""


# 2: Sample.teacher_topk_ids / teacher_topk_logprobs are arrays (tensor frames), not nested lists
# (Sample.rollout_nucleus_* came later as optional fields: a peer without them ignores them and
# sends none, which the trainer reads as "no recorded nucleus"; no new version; likewise
# Sample.teacher_coef, read as 1.0 when absent, and Sample.teacher_sorted_*, as no term)
PROTOCOL_VERSION = 2


class Kind(enum.IntEnum):
    """What a header frame carries."""

    REQUEST = 1  # expects exactly one REPLY or ERROR with the same id
    REPLY = 2
    ERROR = 3  # body is an ErrorReply
    EVENT = 4  # fire-and-forget (streams, metrics, heartbeats)


class Msg(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """Base of every message; the tag (class name) selects the type on decode."""


# ----------------------------------------------------------------------------- handshake / errors
class Hello(Msg):
    """First request a client sends on a new connection."""

    protocol: int
    actor: str  # sender's actor name ("" for tools such as launch.watch)
    role: str = ""
    pid: int = 0
    # hex HMAC-SHA256 of "actor\0role" under the run's token (ActorContext.run_token): proves
    # the role to a server of the same run; requests only a role may send need it
    proof: str = ""


class Welcome(Msg):
    protocol: int
    actor: str  # the server's actor name


class ErrorReply(Msg):
    """A typed error answer. `code` is one of ErrorCode; `message` says what to change."""

    code: str
    message: str
    request_type: str = ""


class ErrorCode(enum.StrEnum):
    UNDECODABLE = "undecodable"  # header frame is not a valid message
    UNKNOWN_MESSAGE = "unknown_message"  # a message type this build does not know
    PROTOCOL_MISMATCH = "protocol_mismatch"
    TOO_LARGE = "too_large"  # over a transport.codec.Limits limit (frames, bytes, depth, ...)
    TRUNCATED = "truncated"  # fewer tensor frames than the header announced
    INVALID_VALUE = "invalid_value"  # well-typed, but a value is out of range (message says which)
    NO_HANDLER = "no_handler"  # a valid message this actor does not serve
    FORBIDDEN = "forbidden"  # the connection's handshake did not prove the role the request needs
    HANDLER_ERROR = "handler_error"  # the handler raised
    DEADLINE = "deadline"  # the caller's deadline passed
    SHUTTING_DOWN = "shutting_down"


# ----------------------------------------------------------------------------- control plane
class Ping(Msg):
    payload: bytes = b""


class Pong(Msg):
    actor: str
    status: str
    payload: bytes = b""


class StatsRequest(Msg):
    pass


class StatsReply(Msg):
    actor: str
    status: str
    uptime_s: float
    counters: dict[str, int] = {}


class Shutdown(Msg):
    reason: str = "requested"


class ShutdownReply(Msg):
    actor: str
    status: str


class Endpoints(Msg):
    """Where an actor can be reached. Empty string: the actor does not bind that socket."""

    control: str
    rpc: str = ""
    inbox: str = ""
    http: str = ""  # base URL of an HTTP server the actor runs (inference workers, router)
    devices: list[str] = []  # physical GPUs it computes on (runtime/devices.py ids; [] = CPU)


class Ready(Msg):
    """Actor -> supervisor, once start() succeeded."""

    actor: str
    pid: int
    endpoints: Endpoints


class Heartbeat(Msg):
    actor: str
    status: str
    seq: int


class Dead(Msg):
    """Actor -> supervisor on a fatal error, just before exiting non-zero."""

    actor: str
    error: str
    traceback: str = ""
    end_run: bool = False  # restarting would not help (e.g. every episode fails): end the run


class Notice(Msg):
    """Actor -> supervisor: a line the launcher prints on its console (problems a user must see
    while the run goes on, such as failing episodes)."""

    actor: str
    text: str


class Ack(Msg):
    """Supervisor -> actor: the Ready/Heartbeat/Dead/Stopped was recorded."""

    ok: bool = True
    stop: bool = False  # the supervisor asks the actor to stop (e.g. after a restart race)


class Stopped(Msg):
    """Actor -> supervisor after an orderly stop; `completed` means its work is done."""

    actor: str
    reason: str
    completed: bool = False


# ----------------------------------------------------------------------------- metrics
class SampleRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One episode as a user reads it, riding on a metrics record (`Metrics.samples`): text,
    not tokens, each text cut to `SAMPLE_TEXT_CHARS` by the sender (transport/metrics.py
    `sample_record`), so a huge response never makes a huge record."""

    kind: str  # "rollout" (a training batch's sample) | "eval" (an evaluation's response)
    domain: str = ""
    prompt: str = ""
    response: str = ""
    reward: float = 0.0
    weight_version: int = 0  # oldest weight version that produced any of its tokens
    status: str = "ok"  # ok | failed | aborted (Sample.status)
    error: str = ""  # the exception, when it failed
    task: str = ""  # the task's id
    env: str = ""  # the environment's class name
    episode: str = ""  # "<group id>-<index>"
    # why a failed episode failed: "env" (the environment's own code raised or ran past its
    # time) or "generation" (the workers failed it); "" when it did not fail
    cause: str = ""


# the longest text of a SampleRecord field, characters (the rest is cut, marked with "...")
SAMPLE_TEXT_CHARS = 2000


class Metrics(Msg):
    """One metrics record. `seq` increases by one per publisher so subscribers can count gaps.

    `samples` (optional, later than the rest: a record without it decodes as before, and a
    peer that does not know it ignores it): a few episodes in text form, the rollout's sample
    of each batch and every response of an evaluation (launch/sinks.py writes them to
    <run_dir>/samples/*.jsonl, not to metrics.jsonl)."""

    actor: str
    seq: int
    time_s: float
    values: dict[str, float] = {}
    step: int | None = None
    total_steps: int | None = None
    dropped: int = 0  # records this publisher dropped so far (never blocked on)
    samples: list[SampleRecord] = []


# ----------------------------------------------------------------------------- RL loop
TOPK_IDS_DTYPE = np.dtype(np.int32)  # Sample.teacher_topk_ids
TOPK_LOGPROBS_DTYPE = np.dtype(np.float32)  # Sample.teacher_topk_logprobs
NUCLEUS_IDS_DTYPE = np.dtype(np.int32)  # Sample.rollout_nucleus_ids and _offsets
NUCLEUS_LOGMASS_DTYPE = np.dtype(np.float32)  # Sample.rollout_nucleus_logmass


class Sample(Msg):
    """One episode, ready for training. Token lists are response-aligned with each other."""

    group_id: str  # one prompt; a GRPO group is the samples sharing it
    index: int  # position within the group
    domain: str
    prompt_ids: list[int]
    response_ids: list[int]  # everything after the prompt: policy and observation tokens
    loss_mask: list[int]  # 1 = policy token (trained on), 0 = observation token
    rollout_logprobs: list[float]  # log-prob of each response token under the rollout policy
    reward: float = 0.0
    weight_version: int = 0  # oldest weight version that produced any of its tokens
    status: str = "ok"  # ok | failed | aborted
    error: str = ""
    # distillation (set by the teacher pool): the teacher this sample is routed to ("" = none),
    # and, in server mode, the teacher's log-probs of the response tokens (response-aligned) and
    # its top-k per response position: [len(response_ids), k] arrays (TOPK_IDS_DTYPE token ids,
    # TOPK_LOGPROBS_DTYPE log-probs), both or neither; arrays travel as tensor frames, not in
    # the header (a 64 x 4096-token batch of top-20 would otherwise be ~12 M msgpack numbers)
    teacher: str = ""
    # that teacher's `coef` (logic/teachers.py TeacherSpec), set by the pool with the route: the
    # trainer of a server-mode run, which holds no teacher list, weighs the sample's OPD term by it
    teacher_coef: float = 1.0
    teacher_logprobs: list[float] = []
    teacher_topk_ids: np.ndarray | None = None
    teacher_topk_logprobs: np.ndarray | None = None
    # a teacher of another vocabulary with opd uld_coef > 0: the response positions [m]
    # (TOPK_IDS_DTYPE, increasing) given the sorted-probability term, and the teacher's top-k
    # log-probs there [m, k] (TOPK_LOGPROBS_DTYPE): both or neither (logic/teachers.py
    # `CrossVocab.onto_student`)
    teacher_sorted_positions: np.ndarray | None = None
    teacher_sorted_logprobs: np.ndarray | None = None
    # the top-p nucleus each response token was sampled from, as the rollout recorded it
    # (engine/session.py, `nucleus_top_logprobs`; top_p OPD and top_p_replay read it): token j's
    # ids are rollout_nucleus_ids[offsets[j]:offsets[j + 1]] (ragged, NUCLEUS_IDS_DTYPE; an
    # empty range for observation tokens), offsets [len(response_ids) + 1]; logmass
    # [len(response_ids)] (NUCLEUS_LOGMASS_DTYPE) is log of the nucleus' mass under the rollout
    # policy at its temperature (0 for observation tokens). All three or none.
    rollout_nucleus_ids: np.ndarray | None = None
    rollout_nucleus_offsets: np.ndarray | None = None
    rollout_nucleus_logmass: np.ndarray | None = None
    # mixture-of-experts models: the experts the inference engine routed each token to, as
    # SGLang's `return_routed_experts` gives them: [n, num_hidden_layers, top_k] expert ids
    # (ROUTED_EXPERTS_DTYPES; rows of layers without routed experts are 0) for the first n
    # positions of prompt_ids + response_ids (n = the tokens the engine ran through the model,
    # at most their count - 1: the last token is never an input). The trainer can replay them
    # (training config `moe.routing_replay`); positions past n route themselves
    routed_experts: np.ndarray | None = None


ROUTED_EXPERTS_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))


def routed_experts_dtype(num_experts: int) -> np.dtype:
    """The smallest of ROUTED_EXPERTS_DTYPES that holds expert ids below `num_experts`."""
    for dtype in ROUTED_EXPERTS_DTYPES:
        if num_experts - 1 <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"{num_experts} experts do not fit int32 ids")


class SampleGroup(Msg):
    """Rollout -> buffer (stream): every sample of one prompt."""

    samples: list[Sample]
    # sent again to a restarted buffer through a stream (e.g. via the teacher pool): the buffer
    # counts the samples it already holds as copies, not as new or duplicated samples
    resent: bool = False
    # what the group was sampled at (None: not said); the buffer refuses a group whose values
    # are not the run's (runtime/facts.py): the trainer computes its log-probs at the run's
    temperature: float | None = None
    top_p: float | None = None


class RolloutPermit(Msg):
    """Rollout -> buffer: may generation of batch `batch_index` start? Answered when it may.
    With `position_only`: only where to start (the trainer's step, once it announced itself);
    it permits no batch, so the buffer counts nothing as being generated for it."""

    batch_index: int
    position_only: bool = False


class Permit(Msg):
    trainer_version: int
    start_batch: int  # the first batch the trainer still needs (resume position)
    buffer_epoch: str = ""  # changes when the buffer process restarts (re-send recent groups)


class GetBatch(Msg):
    """Trainer -> buffer: the next batch for optimizer step `step`, answered when ready."""

    step: int
    trainer_version: int
    trainer_epoch: str = ""  # one per trainer process: a new one means it restarted (resumed)


class TrainBatch(Msg):
    step: int
    samples: list[Sample]
    counters: dict[str, int] = {}  # buffer counters at the time of the batch
    next_teachers: list[str] = []  # teachers of the groups already queued for the next batch


class VersionUpdate(Msg):
    """Trainer -> buffer: the workers now serve `version`; training continues at `step`."""

    version: int
    step: int
    trainer_epoch: str = ""  # as in GetBatch
    checkpointed: bool = False  # the trainer saved a checkpoint at `step`: no replay before it


class EvalRequest(Msg):
    """Trainer -> rollout: score the eval tasks of every domain with the current weights."""

    step: int


class EvalReply(Msg):
    scores: dict[str, float]  # mean eval reward per domain
    num_tasks: dict[str, int] = {}


# ----------------------------------------------------------------------------- weight memory
class ReadToHost(Msg):
    """Trainer -> prefetcher: read weight set `tag` from the NVMe tier into a region of the
    shared pinned arena (`arena` name, byte `offset`, `nbytes`)."""

    tag: str
    arena: str
    offset: int
    nbytes: int
    nvme_dir: str
    verify: bool = True  # check every chunk's checksum


class ReadToHostReply(Msg):
    tag: str
    nbytes: int
    seconds: float
    direct: bool  # False: O_DIRECT was refused and the read used the page cache


Message = Union[
    Hello, Welcome, ErrorReply, Ping, Pong, StatsRequest, StatsReply, Shutdown, ShutdownReply,
    Endpoints, Ready, Heartbeat, Dead, Notice, Ack, Stopped, Metrics, Sample, SampleGroup,
    RolloutPermit, Permit, GetBatch, TrainBatch, VersionUpdate, EvalRequest, EvalReply, ReadToHost,
    ReadToHostReply,
]


class Header(msgspec.Struct, array_like=True):
    """First frame of every message."""

    v: int  # PROTOCOL_VERSION of the sender
    kind: Kind
    id: int  # request id, echoed by the reply; 0 for events
    body: Message


# user message types by tag (register_messages): the extension point of the closed union above
_USER: dict[str, type[Msg]] = {}


def register_messages(*types: type[Msg]) -> None:
    """Message types of user actors (examples/demo.py): every Codec made after this call decodes
    them too. A type's tag (its class name unless given) must be no project message's and no
    other registered type's."""
    project = {t.__struct_config__.tag for t in typing.get_args(Message)}
    for t in types:
        if not (isinstance(t, type) and issubclass(t, Msg)):
            raise TypeError(f"{t!r} is not a subclass of transport.schema.Msg")
        tag = t.__struct_config__.tag
        if tag in project or _USER.get(tag, t) is not t:
            raise ValueError(f"message tag {tag!r} is taken (a project message or another "
                             f"registered type): rename the class")
        _USER[tag] = t


def header_type() -> type:
    """The header struct a Codec decodes: its body is any project or registered message."""
    return _header_for(tuple(_USER.values()))


@functools.lru_cache(maxsize=16)
def _header_for(extra: tuple[type[Msg], ...]) -> type:
    if not extra:
        return Header
    return msgspec.defstruct("Header", [("v", int), ("kind", Kind), ("id", int),
                                        ("body", Union[(Message, *extra)])], array_like=True)
