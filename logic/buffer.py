"""The rollout buffer's logic (pure: no sockets, no asyncio): samples in, trainer batches out.

Samples arrive one by one from the rollout, grouped by prompt (`group_id`, GRPO group) and indexed
0..group_size-1 within a group. A group is *complete* once all group_size indices arrived, "ok"
or not; a complete group with at least min_ok_per_group ok samples is *ready*, and `next_batch`
emits the ok samples of exactly groups_per_batch ready groups: the lowest group version first
(those closest to going stale), oldest completion first among equal versions. With many
producers, completions come out of version order (a group generated slowly at version v completes
after groups of v + 1); taking completion order alone let the slow ones go stale, and every
stale group permits a make-up batch, which adds producers' load: measured by bench/scale.py.

Staleness, precisely:
- The trainer's version v is the number of optimizer steps applied to its weights (0 = the initial
  weights). With one batch per step, the trainer consumes batch i at version i and its step makes
  version i + 1.
- A sample's `weight_version` w is the oldest policy version that produced any of its tokens. A
  group's version is the minimum w over its ok samples (failed/aborted samples are never trained
  on, so they do not count; a group with no ok sample yet has no version and is never stale).
- A group is fresh at trainer version v iff its version >= v - max_staleness, i.e. its staleness
  v - version is at most max_staleness. Whenever the buffer learns a new v (`set_trainer_version`,
  `next_batch`) it drops every group, pending or ready, that is no longer fresh; a sample that
  makes its group stale on arrival drops the group at once. Versions never decrease.
- Permit rule (`may_start_batch`): the rollout may start generating batch i once
  v >= i - max_staleness. Such a batch has w >= i - max_staleness and, consumed at version i, is
  at most max_staleness versions old. max_staleness = 0 is synchronous on-policy (batch i waits for
  version i: generation and training alternate); 1 lets batch i + 1 be generated while the trainer
  steps on batch i. Dropped groups are made up for: each groups_per_batch of them (rounded up)
  permit one batch more, so failed episodes cost extra generation, never a stalled run; the
  staleness bound itself is enforced where it matters, when groups are emitted.
- Steps: `batch_for_step` remembers the batch emitted for each optimizer step (the last
  `replay_steps` of them), so asking again for a step returns the same batch, and a trainer
  restarted from a checkpoint (`restart_trainer`) trains again on exactly the batches its lost
  steps consumed; `forget_before` drops what a checkpoint made unnecessary.

Invariant (`accounting()`): every sample `add()` accepted is in exactly one place: emitted,
pending (an open group, or a ready one not yet emitted), or one `dropped_*` counter:
- dropped_duplicate: its (group_id, index) arrived before, or its group was already complete
  (a second generation of the same sample, e.g. by a restarted rollout);
- dropped_stale: its group was (or became) stale;
- dropped_overflow: its group would have exceeded max_pending_groups (later siblings follow);
- dropped_failed_group: its complete group had fewer than min_ok_per_group ok samples;
- dropped_failed_sample: it was failed/aborted in a group that was kept (its ok siblings go on).
Group ids of complete or dropped groups are remembered for the buffer's lifetime (one dict entry
each), so no group is ever emitted twice (checked: one closed "complete" id per
groups_completed).

Re-sent groups (`add_resent`): a producer sends its recent groups again to a restarted buffer,
some of which the buffer already has (from its journal) and some it never got (lost in flight to
the process that died). A re-sent sample already in the books is a copy, counted in
`resent_copies` only: it is not `added` again, so the books count every sample once. One that is
not goes in as any sample (`added`, and `resent_taken` too) and is remembered: if its first copy
still arrives later (a stream drained after the re-send), that one is counted in
`late_originals` only. So a producer's count of samples it generated equals `added` plus what is
still in flight to the buffer, and its count of re-sent samples resent_copies + resent_taken.
Groups are assumed whole (as the rollout sends them): a re-sent sample of a closed group is a
copy. Limit: a key remembered that way and generated again by a restarted producer counts as a
late original, not as dropped_duplicate.

Costs, for long runs with many producers (bench/scale.py): adding a sample and emitting a batch
never scan the closed group ids; a new trainer version scans the open groups once; the batches
kept for replay (`history`) are held encoded (msgpack), about a seventh of their size as Python
lists of numbers.

Snapshots (`snapshot`, `restore`): the whole state but the config, so that the buffer actor can
replace its journal by one record (compaction) and replay it to exactly this state.

Input checks (`check_sample`, `check_group`, `check_version`) are pure and raise ValueError saying
what to change; the actor runs them before anything changes state and answers or counts the
refusal (a refused group or version changes nothing).
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterator

import msgspec
import numpy as np

from runtime.facts import RunFacts
from transport import records
from transport.schema import (
    ROUTED_EXPERTS_DTYPES,
    TOPK_IDS_DTYPE,
    TOPK_LOGPROBS_DTYPE,
    Sample,
)

STATUSES = ("ok", "failed", "aborted")
SAMPLE_COUNTERS = ("added", "emitted", "dropped_duplicate", "dropped_stale", "dropped_overflow",
                   "dropped_failed_group", "dropped_failed_sample", "resent_copies", "resent_taken",
                   "late_originals")
GROUP_COUNTERS = ("groups_completed", "groups_emitted", "groups_dropped_stale",
                  "groups_dropped_failed", "groups_dropped_overflow", "batches_emitted",
                  "batches_replayed", "batches_not_replayable", "trainer_restarts")
CLOSED = ("complete", "stale", "overflow")  # why a group id is closed


class BufferConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The buffer's own settings; the batch's shape (group size, groups per batch) is the run's,
    decided by the rollout (RunFacts)."""

    max_staleness: int = 0  # 0 = synchronous on-policy; k >= 1 keeps samples up to k versions old
    max_pending_groups: int = 1024  # open plus ready-but-not-emitted groups held at most
    min_ok_per_group: int = 2  # a complete group with fewer ok samples is dropped
    max_sample_tokens: int = 1 << 20  # prompt plus response tokens of one sample, at most
    # emitted batches kept by step, so a trainer restarted from a checkpoint trains again on
    # exactly the batches its lost steps had consumed (steps since its last checkpoint)
    replay_steps: int = 64
    # the buffer actor's journal (<run_dir>/buffer/<name>.journal, replayed on restart) is
    # rewritten as one snapshot of the live state once this many bytes, and at least the
    # snapshot's own size, were appended since the last one, so it stays under twice its last
    # snapshot plus this; 0 = never (it then grows with the run, by about 23 kB a step on
    # examples/local.toml)
    journal_compact_bytes: int = 1 << 20

    def __post_init__(self):
        for name, value in (("max_pending_groups", self.max_pending_groups),
                            ("min_ok_per_group", self.min_ok_per_group),
                            ("max_sample_tokens", self.max_sample_tokens)):
            if value < 1:
                raise ValueError(f"buffer config: {name} must be >= 1, got {value}")
        if self.journal_compact_bytes < 0:
            raise ValueError(f"buffer config: journal_compact_bytes must be >= 0 (0 = never "
                             f"compact), got {self.journal_compact_bytes}")
        if self.max_staleness < 0:
            raise ValueError(f"buffer config: max_staleness must be >= 0 (0 = on-policy), "
                             f"got {self.max_staleness}")

    def check_facts(self, facts: RunFacts) -> None:
        """ValueError unless these settings fit the run's batch shape."""
        if facts.group_size < 1 or facts.groups_per_batch < 1:
            raise ValueError(f"the run's group_size ({facts.group_size}) and groups_per_batch "
                             f"({facts.groups_per_batch}) must be >= 1: a buffer needs a "
                             f"rollout that decides them")
        if self.min_ok_per_group > facts.group_size:
            raise ValueError(f"min_ok_per_group ({self.min_ok_per_group}) must be <= the run's "
                             f"group_size ({facts.group_size}), else every group is dropped")
        if self.max_pending_groups < facts.groups_per_batch:
            raise ValueError(f"max_pending_groups ({self.max_pending_groups}) must be >= the "
                             f"run's groups_per_batch ({facts.groups_per_batch}), else no batch "
                             f"can ever fill")


def check_sample(sample: Sample, config: BufferConfig, facts: RunFacts) -> None:
    """ValueError (saying what to change) unless `sample` may enter a buffer with `config` in
    a run with `facts`."""
    if not isinstance(sample, Sample):
        raise ValueError(f"add() takes a Sample, got {type(sample).__name__}")
    where = f"sample ({sample.group_id[:64]!r}, {sample.index})"
    if not 0 <= sample.index < facts.group_size:
        raise ValueError(f"{where}: index must be in [0, {facts.group_size}) (the run's "
                         f"group_size)")
    if sample.status not in STATUSES:
        raise ValueError(f"{where}: status must be one of {STATUSES}, got {sample.status[:64]!r}")
    tokens = len(sample.prompt_ids) + len(sample.response_ids)
    if tokens > config.max_sample_tokens:
        raise ValueError(f"{where}: {tokens} prompt plus response tokens, limit is "
                         f"{config.max_sample_tokens} (buffer config max_sample_tokens)")
    _check_token_ids(sample, facts.vocab_size, where)
    if sample.weight_version < 0 or not math.isfinite(sample.reward):
        raise ValueError(f"{where}: weight_version must be >= 0 and reward finite, got "
                         f"{sample.weight_version} and {sample.reward}")
    _check_ok_lengths(sample, where)


def _check_token_ids(sample: Sample, vocab_size: int, where: str) -> None:
    """Ids >= 0 and, when the run knows its vocabulary, below its size: the trainer's
    embedding has no row for any other, and a restarted trainer would meet the sample again."""
    low = min(min(sample.prompt_ids, default=0), min(sample.response_ids, default=0))
    if low < 0:
        raise ValueError(f"{where}: token ids must be >= 0, got {low}")
    if vocab_size:
        high = max(max(sample.prompt_ids, default=0), max(sample.response_ids, default=0))
        if high >= vocab_size:
            raise ValueError(f"{where}: token id {high} is outside the policy's vocabulary "
                             f"(vocab_size {vocab_size}): tokenize with the policy's tokenizer")


def _check_ok_lengths(sample: Sample, where: str) -> None:
    if sample.status != "ok":
        return
    n = len(sample.response_ids)
    if not len(sample.loss_mask) == len(sample.rollout_logprobs) == n:
        raise ValueError(f"{where}: loss_mask ({len(sample.loss_mask)}) and "
                         f"rollout_logprobs ({len(sample.rollout_logprobs)}) must have the "
                         f"length of response_ids ({n})")
    if not set(sample.loss_mask) <= {0, 1}:
        raise ValueError(f"{where}: loss_mask may hold only 0 and 1")
    if len(sample.teacher_logprobs) > n:
        raise ValueError(f"{where}: teacher log-probs must not outnumber the {n} response tokens")
    _check_topk(sample, n, where)
    _check_sorted(sample, n, where)
    _check_routes(sample, where)


def _check_routes(sample: Sample, where: str) -> None:
    """Routed experts, when present: [n, layers, k] of ROUTED_EXPERTS_DTYPES, n at most the
    sample's tokens - 1 (the positions that are model inputs with a next token)."""
    routes = sample.routed_experts
    if routes is None:
        return
    if not isinstance(routes, np.ndarray) or routes.dtype not in ROUTED_EXPERTS_DTYPES:
        got = routes.dtype if isinstance(routes, np.ndarray) else type(routes).__name__
        raise ValueError(f"{where}: routed_experts must be an array of one of "
                         f"{[str(d) for d in ROUTED_EXPERTS_DTYPES]}, got {got}")
    limit = len(sample.prompt_ids) + len(sample.response_ids) - 1
    if routes.ndim != 3 or routes.shape[0] > limit or min(routes.shape[1:], default=0) < 1:
        raise ValueError(f"{where}: routed_experts {tuple(routes.shape)} must be [n, layers, "
                         f"top_k] with n <= {limit} (the sample's tokens - 1)")
    if routes.size and routes.min() < 0:
        raise ValueError(f"{where}: routed_experts ids must be >= 0")


def _check_topk(sample: Sample, n: int, where: str) -> None:
    """Top-k, when present: [n, k] arrays of Sample's dtypes, ids >= 0, log-probs finite."""
    ids, lps = sample.teacher_topk_ids, sample.teacher_topk_logprobs
    if not _array_pair(("teacher_topk_ids", ids), ("teacher_topk_logprobs", lps), "top-k",
                       where):
        return
    if ids.ndim != 2 or ids.shape != lps.shape or ids.shape[0] != n or ids.shape[1] < 1:
        raise ValueError(f"{where}: teacher top-k ids {ids.shape} and log-probs {lps.shape} "
                         f"must both be [{n}, k] (one row per response token, k >= 1)")
    if ids.size and (ids.min() < 0 or not np.isfinite(lps).all()):
        raise ValueError(f"{where}: teacher top-k ids must be >= 0 and log-probs finite")


def _array_pair(ids: tuple[str, object], values: tuple[str, object], what: str,
                where: str) -> bool:
    """False when both fields are None; True when they are arrays of Sample's id and log-prob
    dtypes (TOPK_IDS_DTYPE, TOPK_LOGPROBS_DTYPE); ValueError naming the field otherwise."""
    if ids[1] is None and values[1] is None:
        return False
    for (name, value), dtype in ((ids, TOPK_IDS_DTYPE), (values, TOPK_LOGPROBS_DTYPE)):
        if not isinstance(value, np.ndarray) or value.dtype != dtype:
            got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise ValueError(f"{where}: {name} must be an array of {dtype} (both {what} "
                             f"arrays or neither), got {got}")
    return True


def _check_sorted(sample: Sample, n: int, where: str) -> None:
    """The sorted-probability term's rows, when present: increasing positions [m] in the
    response, log-probs [m, k] finite, of Sample's dtypes."""
    pos, lps = sample.teacher_sorted_positions, sample.teacher_sorted_logprobs
    if not _array_pair(("teacher_sorted_positions", pos), ("teacher_sorted_logprobs", lps),
                       "sorted-term", where):
        return
    if pos.ndim != 1 or lps.ndim != 2 or lps.shape[0] != pos.shape[0] or lps.shape[1] < 1 or \
            (pos.size and (pos.min() < 0 or pos.max() >= n or (np.diff(pos) <= 0).any())) or \
            not np.isfinite(lps).all():
        raise ValueError(f"{where}: teacher sorted-term positions {pos.shape} must be increasing "
                         f"response positions in [0, {n}) and its log-probs {lps.shape} "
                         f"[positions, k >= 1], finite")


def check_group(samples: list[Sample], config: BufferConfig, facts: RunFacts) -> None:
    """ValueError unless `samples` is one whole, valid GRPO group's worth of samples (1 to
    group_size samples sharing one group_id, each passing check_sample)."""
    if not 1 <= len(samples) <= facts.group_size:
        raise ValueError(f"a SampleGroup holds 1 to group_size = {facts.group_size} samples, "
                         f"got {len(samples)}")
    ids = {s.group_id for s in samples}
    if len(ids) != 1:
        raise ValueError(f"a SampleGroup's samples must share one group_id, got {len(ids)}")
    for sample in samples:
        check_sample(sample, config, facts)


def check_version(field: str, seen: int, version: int, step: int, restarted: bool = False,
                  seen_step: int = 0) -> None:
    """ValueError unless trainer version `version` (with optimizer `step`) may follow `seen`,
    the last one announced (-1: none yet): within a trainer process versions never go back and
    advance one at a time; a restarted one resumes from a checkpoint it saved, so it may go
    back, but never past one step beyond where it was (`seen`, `seen_step`)."""
    if version < 0 or step < 0:
        raise ValueError(f"{field} and step must be >= 0, got {field} = {version}, step = {step}")
    if seen < 0:
        return
    if restarted and (version > seen + 1 or step > seen_step + 1):
        raise ValueError(f"a restarted trainer at {field} = {version}, step = {step} refused: "
                         f"the buffer last saw version {seen} at step {seen_step}, and a trainer "
                         f"resumes from a checkpoint it saved (at most one step further)")
    if not restarted and not seen <= version <= seen + 1:
        raise ValueError(f"{field} = {version} refused: the buffer last saw version {seen}, and "
                         f"versions only advance one step at a time (send {seen} or {seen + 1})")


class BufferSnapshot(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Everything a RolloutBuffer holds but its config (`snapshot` / `restore`)."""

    trainer_version: int
    counters: dict[str, int]
    open: list[list[Sample]]  # each incomplete group's samples, in arrival order
    ready: list[list[Sample]]  # ok samples of each ready group, oldest completion first
    closed: dict[str, list[str]]  # "complete" | "stale" | "overflow" -> group ids
    history: dict[int, list[Sample]]  # emitted batch by optimizer step
    replay_from: int = -1
    resent_first: list[tuple[str, int]] = []  # (group_id, index) first taken from a re-send


class History:
    """Emitted batches by optimizer step (a mapping step -> list[Sample]), each held as one
    msgpack record (transport.records): a batch of Python int and float objects takes about
    seven times its encoded size, and `replay_steps` of them are kept. Reading a step decodes
    it (replays and snapshots), but the newest batch stays as it was given, so a request asked
    again for the last step gets that very list."""

    _encoder = records.encoder()
    _decoder = records.decoder(list[Sample])

    def __init__(self, batches: dict[int, list[Sample]] | None = None):
        self._data: dict[int, bytes] = {}
        self._newest: tuple[int, list[Sample]] | None = None
        for step, batch in (batches or {}).items():
            self[step] = batch

    def __setitem__(self, step: int, batch: list[Sample]) -> None:
        self._data[step] = self._encoder.encode(batch)
        self._newest = (step, batch)

    def __getitem__(self, step: int) -> list[Sample]:
        if self._newest is not None and self._newest[0] == step and step in self._data:
            return self._newest[1]
        return self._decoder.decode(self._data[step])

    def __delitem__(self, step: int) -> None:
        del self._data[step]
        if self._newest is not None and self._newest[0] == step:
            self._newest = None

    def __contains__(self, step: object) -> bool:
        return step in self._data

    def __iter__(self) -> Iterator[int]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __bool__(self) -> bool:
        return bool(self._data)

    def items(self) -> Iterator[tuple[int, list[Sample]]]:
        return ((step, self[step]) for step in self._data)

    def nbytes(self) -> int:
        return sum(map(len, self._data.values()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, History) and self._data == other._data

    def __repr__(self) -> str:
        return f"History(steps={sorted(self._data)}, bytes={self.nbytes()})"


class RolloutBuffer:
    """Groups samples, drops what is stale, failed or repeated, and cuts trainer batches."""

    def __init__(self, config: BufferConfig, facts: RunFacts):
        config.check_facts(facts)
        self.config, self.facts = config, facts
        self.trainer_version = 0
        self.counters = dict.fromkeys(SAMPLE_COUNTERS + GROUP_COUNTERS, 0)
        self._open: dict[str, dict[int, Sample]] = {}  # incomplete groups by index
        self._ready: dict[str, list[Sample]] = {}  # ok samples of ready groups, completion order
        # the ready group ids by group version, each in completion order (emission order)
        self._by_version: dict[int, dict[str, None]] = {}
        self._closed: dict[str, str] = {}  # group id -> "complete" | "stale" | "overflow"
        self._closed_count: collections.Counter = collections.Counter()  # reason -> ids
        self.history = History()  # emitted batch by optimizer step
        self._replay_from = -1  # a restarted trainer replays history from this step on
        # samples that went in from a re-send (their first copy was not here): that first copy,
        # should it still arrive, is a late original
        self._resent_first: set[tuple[str, int]] = set()

    # ------------------------------------------------------------------ input
    def add(self, sample: Sample) -> str:
        """Take one sample; returns what became of it: "pending", "complete" (its group is now
        ready), the dropped_* counter it went to, or "late_originals" (the first copy of a
        sample already taken from a re-send). ValueError for a malformed sample (not
        counted)."""
        self._validate(sample)
        gid = sample.group_id
        if (gid, sample.index) in self._resent_first:
            self._resent_first.discard((gid, sample.index))
            return self._count("late_originals", 1)
        self.counters["added"] += 1
        if gid in self._closed:
            reason = {"complete": "dropped_duplicate", "stale": "dropped_stale",
                      "overflow": "dropped_overflow"}[self._closed[gid]]
            return self._count(reason, 1)
        group = self._open.get(gid)
        if group is None:
            if self.pending_capacity_left() == 0:
                self._close(gid, "overflow")
                self.counters["groups_dropped_overflow"] += 1
                return self._count("dropped_overflow", 1)
            group = self._open[gid] = {}
        if sample.index in group:
            return self._count("dropped_duplicate", 1)
        group[sample.index] = sample
        if self._is_stale(group.values()):
            self._drop_open_stale(gid)
            return "dropped_stale"
        if len(group) == self.facts.group_size:
            return self._complete(gid)
        return "pending"

    def add_resent(self, sample: Sample) -> str:
        """Take one sample of a group its producer sent again (to a restarted buffer): a copy
        of a sample already in the books is counted in `resent_copies` and nothing else; any
        other goes in as `add` takes it (and counts in `resent_taken`). Returns as `add`."""
        self._validate(sample)
        gid, index = sample.group_id, sample.index
        if gid in self._closed or index in self._open.get(gid, ()):
            return self._count("resent_copies", 1)
        outcome = self.add(sample)
        self.counters["resent_taken"] += 1
        self._resent_first.add((gid, index))
        return outcome

    def _validate(self, sample: Sample) -> None:
        check_sample(sample, self.config, self.facts)

    def _count(self, counter: str, samples: int) -> str:
        self.counters[counter] += samples
        return counter

    def _close(self, gid: str, reason: str) -> None:
        self._closed[gid] = reason
        self._closed_count[reason] += 1

    def _ready_put(self, gid: str, ok: list[Sample]) -> None:
        self._ready[gid] = ok
        self._by_version.setdefault(min(s.weight_version for s in ok), {})[gid] = None

    def _ready_take(self, gid: str) -> list[Sample]:
        ok = self._ready.pop(gid)
        version = min(s.weight_version for s in ok)
        bucket = self._by_version[version]
        del bucket[gid]
        if not bucket:
            del self._by_version[version]
        return ok

    def _emission_order(self) -> Iterator[str]:
        """Ready group ids in the order `next_batch` takes them."""
        for version in sorted(self._by_version):
            yield from self._by_version[version]

    def _complete(self, gid: str) -> str:
        group = self._open.pop(gid)
        self._close(gid, "complete")
        self.counters["groups_completed"] += 1
        ok = [group[i] for i in sorted(group) if group[i].status == "ok"]
        if len(ok) < self.config.min_ok_per_group:
            self.counters["groups_dropped_failed"] += 1
            return self._count("dropped_failed_group", len(group))
        self._count("dropped_failed_sample", len(group) - len(ok))
        self._ready_put(gid, ok)
        return "complete"

    # ------------------------------------------------------------------ staleness
    def _is_stale(self, samples) -> bool:
        versions = [s.weight_version for s in samples if s.status == "ok"]
        return bool(versions) and min(versions) < self.trainer_version - self.config.max_staleness

    def _drop_open_stale(self, gid: str) -> None:
        group = self._open.pop(gid)
        self._close(gid, "stale")
        self.counters["groups_dropped_stale"] += 1
        self._count("dropped_stale", len(group))

    def set_trainer_version(self, version: int) -> None:
        """The trainer now holds `version`; drops every group that is no longer fresh."""
        if version < self.trainer_version:
            raise ValueError(f"trainer version went back from {self.trainer_version} to "
                             f"{version}; versions only increase")
        if version == self.trainer_version:  # nothing went stale since the last scan: a group
            return  # is checked on every sample's arrival, and only a new version ages it
        self.trainer_version = version
        for gid in [g for g, group in self._open.items() if self._is_stale(group.values())]:
            self._drop_open_stale(gid)
        oldest_fresh = version - self.config.max_staleness
        for old in [v for v in self._by_version if v < oldest_fresh]:
            for gid in list(self._by_version[old]):
                self.counters["groups_dropped_stale"] += 1
                self._count("dropped_stale", len(self._ready_take(gid)))

    # ------------------------------------------------------------------ output
    def next_batch(self, trainer_version: int) -> list[Sample] | None:
        """The ok samples of groups_per_batch ready, fresh groups (lowest group version first,
        then completion order; each group in index order), or None while fewer are ready."""
        self.set_trainer_version(trainer_version)
        n = self.facts.groups_per_batch
        if len(self._ready) < n:
            return None
        batch = []
        for gid in list(itertools.islice(self._emission_order(), n)):
            batch += self._ready_take(gid)
        self.counters["groups_emitted"] += n
        self.counters["batches_emitted"] += 1
        self._count("emitted", len(batch))
        return batch

    def batch_for_step(self, step: int, trainer_version: int) -> list[Sample] | None:
        """The batch of optimizer step `step`: the one emitted for it before (a repeated request,
        or a restarted trainer replaying lost steps), else `next_batch` (None while not ready).
        Asking again for a step is therefore idempotent."""
        if step in self.history:
            if step >= self._replay_from >= 0:
                self.counters["batches_replayed"] += 1
                self._replay_from = step + 1
            return self.history[step]
        batch = self.next_batch(trainer_version)
        if batch is not None:
            self.history[step] = batch
            for old in [s for s in self.history if s <= step - self.config.replay_steps]:
                del self.history[old]
        return batch

    def restart_trainer(self, version: int, step: int) -> None:
        """A trainer process resumed from a checkpoint at (`version`, `step`): versions may go
        back (a lower version keeps every held group fresh); the batches it emitted for steps
        >= `step` are handed out again, in order, before any new one."""
        self.counters["trainer_restarts"] += 1
        lost = [s for s in self.history if s >= step]
        if self.history and step < min(self.history) and lost:
            self.counters["batches_not_replayable"] += min(self.history) - step
        self.trainer_version = version
        self._replay_from = step

    def forget_before(self, step: int) -> None:
        """The trainer checkpointed at `step`: batches of earlier steps are never replayed."""
        for old in [s for s in self.history if s < step]:
            del self.history[old]

    def upcoming_teachers(self) -> list[str]:
        """Teachers of the ready groups (the next batch's), in the order they will be trained:
        a hint for the trainer's weight memory to load the first of them early."""
        seen: dict[str, None] = {}
        for gid in itertools.islice(self._emission_order(), self.facts.groups_per_batch):
            for sample in self._ready[gid]:
                if sample.teacher:
                    seen.setdefault(sample.teacher)
        return list(seen)

    def may_start_batch(self, batch_index: int, trainer_version: int,
                        trainer_waiting: bool = False, in_flight_groups: int = 0) -> bool:
        """The rollout's permit: generation of batch `batch_index` (0-based) may start. Groups
        dropped (failed, stale, overflow) are made up for: every groups_per_batch of them (or
        part) allow one batch more, so a batch short of ready groups never stalls the run. And
        whenever the trainer waits for a batch that the groups held (ready or still open) cannot
        fill, generation may go on whatever the batch index (after a trainer went back to an
        older checkpoint than the batches it can replay). `in_flight_groups`: groups of batches
        already permitted that have not arrived (the caller's count): they will fill the batch,
        so they count as held (with several rollout shards asking, the trainer waits while
        their groups are generated; opening every waiting permit then over-produced groups
        that went stale: bench/scale.py)."""
        if batch_index < 0:
            raise ValueError(f"batch_index must be >= 0, got {batch_index}")
        held = len(self._ready) + len(self._open) + in_flight_groups
        if trainer_waiting and held < self.facts.groups_per_batch:
            return True
        return trainer_version >= batch_index - self.config.max_staleness - self.makeup_batches()

    def makeup_batches(self) -> int:
        """Batches the rollout may generate beyond the staleness rule to replace lost groups."""
        dropped = (self.counters["groups_dropped_failed"] + self.counters["groups_dropped_stale"]
                   + self.counters["groups_dropped_overflow"])
        return -(-dropped // self.facts.groups_per_batch)

    def pending_capacity_left(self) -> int:
        """How many more groups may be opened before new ones overflow."""
        return self.config.max_pending_groups - len(self._open) - len(self._ready)

    def ready_groups(self) -> int:
        return len(self._ready)

    def pending_keys(self) -> set[tuple[str, int]]:
        """(group_id, index) of every sample held (open or ready groups)."""
        keys = {(gid, i) for gid, group in self._open.items() for i in group}
        return keys | {(s.group_id, s.index) for ok in self._ready.values() for s in ok}

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> BufferSnapshot:
        """The whole state but the config; `restore` of it gives this state back exactly."""
        closed: dict[str, list[str]] = {reason: [] for reason in CLOSED}
        for gid, reason in self._closed.items():
            closed[reason].append(gid)
        return BufferSnapshot(
            trainer_version=self.trainer_version, counters=dict(self.counters),
            open=[list(group.values()) for group in self._open.values()],
            ready=[list(ok) for ok in self._ready.values()],
            closed={reason: gids for reason, gids in closed.items() if gids},
            history={step: list(batch) for step, batch in self.history.items()},
            replay_from=self._replay_from, resent_first=sorted(self._resent_first))

    def restore(self, snap: BufferSnapshot) -> None:
        """Replace the whole state (but the config) by `snap`'s, in place."""
        unknown = set(snap.closed) - set(CLOSED)
        if unknown or any(not group for group in snap.open + snap.ready):
            raise ValueError(f"buffer snapshot is damaged: closed reasons {sorted(unknown)} "
                             f"(known: {CLOSED}) or an empty group")
        self.trainer_version = snap.trainer_version
        self.counters.clear()
        self.counters.update(dict.fromkeys(SAMPLE_COUNTERS + GROUP_COUNTERS, 0))
        self.counters.update(snap.counters)
        self._open = {group[0].group_id: {s.index: s for s in group} for group in snap.open}
        self._ready, self._by_version = {}, {}
        for ok in snap.ready:
            self._ready_put(ok[0].group_id, list(ok))
        self._closed = {gid: reason for reason, gids in snap.closed.items() for gid in gids}
        self._closed_count = collections.Counter(
            {reason: len(gids) for reason, gids in snap.closed.items() if gids})
        self.history = History(snap.history)
        self._replay_from = snap.replay_from
        self._resent_first = set(snap.resent_first)

    # ------------------------------------------------------------------ accounting
    def accounting(self) -> dict[str, int]:
        """Counters plus `pending`, `open_groups`, `ready_groups`; raises AssertionError unless
        added == emitted + pending + sum(dropped_*) (re-sent copies are in none of them) and
        each completed or overflowed group was so once."""
        pending = sum(map(len, self._open.values())) + sum(map(len, self._ready.values()))
        dropped = sum(v for k, v in self.counters.items() if k.startswith("dropped_"))
        if self.counters["added"] != self.counters["emitted"] + pending + dropped:
            raise AssertionError(f"buffer accounting broken: added {self.counters['added']} != "
                                 f"emitted {self.counters['emitted']} + pending {pending} + "
                                 f"dropped {dropped} ({self.counters})")
        if any(g in self._closed for g in self._open) or any(
                g not in self._closed for g in self._ready):
            raise AssertionError("buffer accounting broken: a group is both open and closed")
        # the closed ids by reason, counted as they were closed (O(1)); recounted (O(ids)) only
        # when the dict disagrees with those counts, to say which reason is off
        reasons = self._closed_count
        if len(self._closed) != sum(reasons.values()):
            reasons = collections.Counter(self._closed.values())
        for reason, counter in (("complete", "groups_completed"),
                                ("overflow", "groups_dropped_overflow")):
            if reasons[reason] != self.counters[counter]:
                raise AssertionError(f"buffer accounting broken: {reasons[reason]} group ids "
                                     f"closed as {reason!r} but {counter} = "
                                     f"{self.counters[counter]} (a group id was forgotten and "
                                     f"its group taken again)")
        return {**self.counters, "pending": pending, "open_groups": len(self._open),
                "ready_groups": len(self._ready)}
