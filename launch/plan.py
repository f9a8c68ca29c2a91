"""The whole plan at once: the run's facts said once (runtime/facts.py), every check across actors.

`check_plan` runs at load, after each actor's own `check_config`, over every actor of the run
(`ActorView`: class, decoded config, host, GPUs, `after`). It checks that each peer an actor names
(`Actor.peers`) is an actor it starts after, derives `RunFacts` from the actors that decide each
fact (the rollout samples: group size, batch, temperature, top-p; the buffer bounds staleness;
the trainer holds the model, dtype, mode, opd; the teacher pool routes the teachers), then checks
every other actor's copy against the fact, naming both tables and the fix. The facts go to every
actor in its context.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.inference import InferenceWorkerConfig
from engine.weight_sync import check_weight_sync_placement
from runtime.actor import ActorView
from runtime.facts import RunFacts, TeacherFact


# each fact and the field that decides it: (the role of the actor, the path in its config)
DECIDED_BY = {"model": ("trainer", "model"), "dtype": ("trainer", "dtype"),
              "mode": ("trainer", "mode"), "true_on_policy": ("trainer", "true_on_policy"),
              "group_size": ("rollout", "group_size"),
              "groups_per_batch": ("rollout", "groups_per_batch"),
              "temperature": ("rollout", "temperature"), "top_p": ("rollout", "top_p"),
              "max_staleness": ("buffer", "max_staleness")}


def fill_facts(actors: dict[str, tuple[type, dict[str, Any]]]) -> None:
    """In place, before the tables are decoded: each fact an actor takes from the run
    (`Actor.fact_fields`) and its table leaves out is copied from the table of the one actor
    that decides it (DECIDED_BY; its default when that table leaves it out too). A table that
    states it keeps its value, which check_plan then compares with the fact."""
    said: dict[str, Any] = {}
    for fact, (role, path) in DECIDED_BY.items():
        deciders = [(cls, raw) for cls, raw in actors.values() if cls.role == role]
        if len(deciders) == 1:
            value = _at(deciders[0][1], path, _default(deciders[0][0].Config, path))
            if value is not msgspec.NODEFAULT:
                said[fact] = value
    for cls, raw in actors.values():
        for path, fact in cls.fact_fields.items():
            if fact in said and _at(raw, path, msgspec.NODEFAULT) is msgspec.NODEFAULT:
                *tables, key = path.split(".")
                node = raw
                for t in tables:
                    node = node.setdefault(t, {})
                node[key] = said[fact]


def _at(raw: Any, path: str, missing: Any) -> Any:
    for key in path.split("."):
        if not isinstance(raw, dict) or key not in raw:
            return missing
        raw = raw[key]
    return raw


def _default(struct: type, path: str) -> Any:
    """The builtin default of a dotted config path (NODEFAULT: a required field)."""
    head, _, rest = path.partition(".")
    field = next(f for f in msgspec.structs.fields(struct) if f.name == head)
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return msgspec.NODEFAULT
    return _at(msgspec.to_builtins(value), rest, msgspec.NODEFAULT) if rest else \
        msgspec.to_builtins(value)


class PlanError(ValueError):
    """A check across actors failed; `actor` is the table the message is about."""

    def __init__(self, actor: str, text: str):
        super().__init__(text)
        self.actor = actor


def check_plan(views: dict[str, ActorView]) -> RunFacts:
    """Raise PlanError for a plan whose actors disagree; else the run's facts."""
    for name, view in views.items():
        _check_peers(name, view, views)
    by_role: dict[str, list[str]] = {}
    for name, view in views.items():
        by_role.setdefault(view.cls.role, []).append(name)
    trainers = by_role.get("trainer", [])
    for name in by_role.get("rollout", []):
        _check_rollout(name, views)
    for name in by_role.get("buffer", []):
        _check_buffer(name, views)
    for name in trainers:
        _check_trainer(name, views)
    return run_facts(views, trainers[0] if trainers else "")


def _check_peers(name: str, view: ActorView, views: dict[str, ActorView]) -> None:
    for field, peer in view.cls.peers(view.config).items():
        if peer and peer not in views:
            raise PlanError(name, f"`{field}` = {peer!r} is not an actor of this run (actors are "
                                  f"{sorted(views)}): name one of them, or add an "
                                  f"[actors.{peer}] table")
        if peer and peer not in view.after:
            raise PlanError(name, f"`{field}` = {peer!r}, but {peer!r} is missing from the "
                                  f"`after` list of [actors.{name}]: add it there (after = [..., "
                                  f"{peer!r}]), so that {name} starts after it and can reach it")


def _feeding(buffer: str, views: dict[str, ActorView], role: str) -> list[str]:
    """The actors of `role` that send their groups to `buffer`."""
    return [n for n, v in views.items() if v.cls.role == role and v.config.buffer == buffer]


def _same(actor: str, field: str, mine: Any, other: str, theirs_field: str, theirs: Any,
          fix: str) -> None:
    """One fact stated in two tables must be one value."""
    if mine != theirs:
        raise PlanError(actor, f"{field} = {mine} here but {theirs_field} = {theirs} in "
                               f"[actors.{other}.config], {fix}")


def _check_rollout(name: str, views: dict[str, ActorView]) -> None:
    """A teacher-pool sink scores at the rollout's temperature, into the rollout's buffer."""
    cfg = views[name].config
    sink = views.get(cfg.sink)
    if sink is not None and sink.cls.role == "teacher_pool":
        _same(name, "temperature", cfg.temperature, cfg.sink, "temperature",
              sink.config.temperature, "the teacher pool this rollout sends to: set the pool's "
              "temperature to the rollout's sampling temperature (teachers score at it)")
        _same(name, "buffer", repr(cfg.buffer), cfg.sink, "buffer", repr(sink.config.buffer),
              "the teacher pool this rollout sends to: the groups must reach the buffer that "
              "gives the rollout its permits; name the same buffer in both")


def _check_buffer(name: str, views: dict[str, ActorView]) -> None:
    """The rollouts feeding a buffer play the groups and batches it completes."""
    cfg, fix = views[name].config, (
        "the rollout feeding this buffer: set both to the same value (the buffer completes "
        "groups of group_size samples and batches of groups_per_batch groups, the rollout plays "
        "exactly those)")
    for other in _feeding(name, views, "rollout"):
        theirs = views[other].config
        _same(name, "group_size", cfg.group_size, other, "group_size", theirs.group_size, fix)
        _same(name, "groups_per_batch", cfg.groups_per_batch, other, "groups_per_batch",
              theirs.groups_per_batch, fix)


def _check_trainer(name: str, views: dict[str, ActorView]) -> None:
    cfg = views[name].config
    buf, buffer = f"[actors.{cfg.buffer}.config]", views[cfg.buffer]
    staleness = buffer.config.max_staleness if buffer.cls.role == "buffer" else 0
    if cfg.mode == "colocated" and staleness != 0:
        raise PlanError(name, f"mode = 'colocated' here needs max_staleness = 0 in {buf} (it is "
                              f"{staleness}): the workers are paused while the trainer trains, "
                              f"so no batch can be generated ahead; set max_staleness = 0 there,"
                              f" or mode = 'decoupled' here")
    for other in _feeding(cfg.buffer, views, "rollout"):
        said = views[other].config.temperature
        _same(name, "loss.temperature", cfg.loss.temperature, other, "temperature", said,
              f"the rollout feeding {buf}: the trainer's log-probs must be at the sampling "
              f"temperature; set loss = {{ temperature = {said} }} here or change the rollout's "
              f"temperature")
    _check_teachers(name, cfg, _feeding(cfg.buffer, views, "teacher_pool"), views)
    for w in cfg.workers:
        _check_invariant(name, cfg, w, views[w])
    try:
        check_weight_sync_placement(cfg.weight_sync.path, cfg.workers,
                                    [views[w].gpus for w in cfg.workers], views[name].gpus,
                                    cfg.device)
    except ValueError as e:
        raise PlanError(name, str(e)) from None


def _check_teachers(name: str, cfg: Any, pools: list[str], views: dict[str, ActorView]) -> None:
    """opd here and a teacher pool routing into the trainer's buffer go together; colocated
    teachers are the pool's list, teacher servers return what the trainer's opd asks for."""
    buf = f"[actors.{cfg.buffer}.config]"
    if cfg.opd is None and pools:
        raise PlanError(name, f"[actors.{pools[0]}] (a teacher pool) routes samples into {buf}, "
                              f"which this trainer trains on, but opd is not set here: add opd ="
                              f" {{ mode = ..., kl_coef = ... }} here (and `teachers` for "
                              f"colocated teachers), or remove the teacher pool")
    if cfg.opd is not None and not pools:
        raise PlanError(name, f"opd is set here, but no teacher pool (actors.teacher_pool:"
                              f"TeacherPool) sends its groups to {buf}, so no sample gets a "
                              f"teacher: add one with buffer = {cfg.buffer!r} and make it the "
                              f"rollout's `sink`, or remove opd")
    for pool in pools:
        there, pc = f"[actors.{pool}.config]", views[pool].config
        if cfg.teachers and pc.mode != "colocated":
            raise PlanError(name, f"`teachers` here run colocated in the trainer, but {there} has"
                                  f" mode = {pc.mode!r}: set mode = 'colocated' there, or remove"
                                  f" `teachers` here to use its teacher servers")
        if cfg.teachers and _teachers(cfg.teachers) != _teachers(pc.teachers):
            raise PlanError(name, f"`teachers` here and in {there} differ (name, model, domains):"
                                  f" here {_teachers(cfg.teachers)}, there {_teachers(pc.teachers)};"
                                  f" the pool routes samples by name to the trainer's teachers: "
                                  f"give both the same list")
        if not cfg.teachers and pc.mode != "server":
            raise PlanError(name, f"opd without `teachers` here takes the teacher signal from "
                                  f"teacher servers, but {there} has mode = 'colocated' (only "
                                  f"routing): set mode = 'server' there (with each teacher's "
                                  f"`worker` or `url`), or list the same `teachers` here to run "
                                  f"them in the trainer")
        if not cfg.teachers and (pc.opd.mode, pc.opd.top_k) != (cfg.opd.mode, cfg.opd.top_k):
            raise PlanError(name, f"opd here (mode = {cfg.opd.mode!r}, top_k = {cfg.opd.top_k}) "
                                  f"and in {there} (mode = {pc.opd.mode!r}, top_k = "
                                  f"{pc.opd.top_k}) differ: the servers return what the pool's "
                                  f"opd asks for and the trainer trains on its own; set the same "
                                  f"opd mode and top_k in both")


def _check_invariant(name: str, cfg: Any, worker: str, view: ActorView) -> None:
    """`true_on_policy` holds only when every worker computes with the trainer's kernels, dtype
    and device kind (models/invariant): embedded workers that set it too."""
    if not isinstance(view.config, InferenceWorkerConfig):
        if cfg.true_on_policy:
            raise PlanError(name, f"true_on_policy = true here, but [actors.{worker}] is not an "
                                  f"embedded inference worker: SGLang's kernels are not this "
                                  f"trainer's, so log-probs cannot be bitwise equal; use embedded "
                                  f"workers, or leave true_on_policy off (SGLang's deterministic "
                                  f"inference: docs/training.md)")
        return
    there = view.config
    if there.true_on_policy != cfg.true_on_policy:
        raise PlanError(name, f"true_on_policy = {str(cfg.true_on_policy).lower()} here but "
                              f"{str(there.true_on_policy).lower()} in [actors.{worker}.config]: "
                              f"the worker and the trainer must both use the invariant kernels "
                              f"(or neither); set the same value in both (or `true_on_policy` in"
                              f" [rl])")
    kinds = there.device.split(":")[0], cfg.device.split(":")[0]
    if cfg.true_on_policy and (there.dtype != cfg.dtype or kinds[0] != kinds[1]):
        raise PlanError(name, f"true_on_policy: dtype {cfg.dtype!r} on {cfg.device!r} here but "
                              f"dtype {there.dtype!r} on {there.device!r} in "
                              f"[actors.{worker}.config]; bitwise equality needs the same dtype "
                              f"and device kind on both sides")


def _teachers(specs: list[Any]) -> list[tuple[str, str, tuple[str, ...]]]:
    return sorted((t.name, t.model, tuple(sorted(t.domains))) for t in specs)


def run_facts(views: dict[str, ActorView], trainer: str) -> RunFacts:
    """The facts, each from the actor that decides it (checked equal everywhere above)."""
    roles = {v.cls.role: v.config for v in views.values()}
    facts: dict[str, Any] = {}
    rollout = roles.get("rollout")
    if rollout is not None:
        facts.update(model=rollout.model, group_size=rollout.group_size,
                     groups_per_batch=rollout.groups_per_batch,
                     temperature=rollout.temperature, top_p=rollout.top_p)
    if "buffer" in roles:
        facts["max_staleness"] = roles["buffer"].max_staleness
    pool = roles.get("teacher_pool")
    if pool is not None:
        facts["teachers"] = [TeacherFact(t.name, t.model, sorted(t.domains)) for t in pool.teachers]
    if trainer:
        cfg = views[trainer].config
        facts.update(model=cfg.model, dtype=cfg.dtype, mode=cfg.mode,
                     true_on_policy=cfg.true_on_policy)
        if cfg.opd is not None:
            facts.update(opd_mode=cfg.opd.mode, opd_top_k=cfg.opd.top_k)
    return RunFacts(**facts)

