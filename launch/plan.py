"""The whole plan at once: the run's facts said once (runtime/facts.py), every check across actors.

A fact of the run is decided by one actor's field (DECIDED_BY: the rollout samples, so it decides
the group size, batch, temperature and top-p; the buffer bounds staleness; the trainer holds the
model, dtype, mode and opd), and said nowhere else: the other actors read it from their context
(`Actor.facts`). Facts are per buffer: the actors that send to a buffer, take batches from it, or
are it, form one pipeline (a run has one, but a layout may hold several). After every actor's
own `check_config`, `check_plan` checks the peers each actor names (`Actor.peers`: actors it
starts after) and what only the whole plan shows (colocated staleness, distillation, true
on-policy workers, the weight-sync placement), naming both tables and the fix; then it derives
each actor's facts, lets each actor check its own settings against them (`Actor.check_facts`),
and returns them, for the launcher to put in every actor's context.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.inference_config import InferenceWorkerConfig
from engine.weight_sync_plan import check_weight_sync_placement
from models.names import checkpoint_vocab_size
from runtime.actor import ActorView
from runtime.facts import DECIDED_BY, RunFacts, TeacherFact
from transport.errors import RlxError

MISSING = msgspec.NODEFAULT
Tables = dict[str, tuple[type, dict[str, Any]]]  # actor name -> (class, its table as builtins)


def _decider(fact: str, buffer: str, actors: Tables) -> tuple[str, Any] | None:
    """(name, value) of the one actor deciding `fact` on `buffer`; None: none or several."""
    role, path = DECIDED_BY[fact]
    found = [(n, cls, raw) for n, (cls, raw) in actors.items()
             if cls.role == role and _buffer(n, cls, raw) == buffer]
    if len(found) != 1:
        return None
    name, cls, raw = found[0]
    value = _at(raw, path)
    value = _default(cls.Config, path) if value is MISSING else value
    return None if value is MISSING else (name, value)


def _buffer(name: str, cls: type, raw: dict[str, Any]) -> str:
    """The buffer whose pipeline an actor belongs to ("" = none: workers, router)."""
    if cls.role == "buffer":
        return name
    said = _at(raw, "buffer")
    said = _default(cls.Config, "buffer") if said is MISSING else said
    return said if isinstance(said, str) else ""


def _at(raw: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(raw, dict) or key not in raw:
            return MISSING
        raw = raw[key]
    return raw


def _default(struct: type, path: str) -> Any:
    """The builtin default of a dotted config path (MISSING: no such field, or required)."""
    head, _, rest = path.partition(".")
    field = next((f for f in msgspec.structs.fields(struct) if f.name == head), None)
    if field is None or (field.default is MISSING and field.default_factory is MISSING):
        return MISSING
    value = msgspec.to_builtins(field.default if field.default is not MISSING
                                else field.default_factory())
    return _at(value, rest) if rest else value


class PlanError(RlxError, ValueError):
    """A check across actors failed; `actor` is the table the message is about."""

    def __init__(self, actor: str, text: str):
        super().__init__(text)
        self.actor = actor


def check_plan(views: dict[str, ActorView]) -> dict[str, RunFacts]:
    """Raise PlanError for a plan whose actors disagree; else each actor's facts, by name."""
    tables = {n: (v.cls, msgspec.to_builtins(v.config)) for n, v in views.items()}
    for name, view in views.items():
        for field, peer in view.cls.peers(view.config).items():
            if peer and peer not in views:
                raise PlanError(name, f"`{field}` = {peer!r} is not an actor of this run (actors "
                                      f"are {sorted(views)}): name one of them, or add an "
                                      f"[actors.{peer}] table")
            if peer and peer not in view.after:
                raise PlanError(name, f"`{field}` = {peer!r}, but {peer!r} is missing from the "
                                      f"`after` list of [actors.{name}]: add it there (after = "
                                      f"[..., {peer!r}]), so that {name} starts after it")
        sink = views.get(view.config.sink) if view.cls.role == "rollout" else None
        if sink and sink.cls.role == "teacher_pool" and sink.config.buffer != view.config.buffer:
            raise PlanError(name, f"buffer = {view.config.buffer!r} here but buffer = "
                                  f"{sink.config.buffer!r} in [actors.{view.config.sink}.config],"
                                  f" the teacher pool this rollout sends to: name one buffer")
        if view.cls.role == "trainer":
            _check_trainer(name, view.config, views)
    trainers = sorted(n for n, v in views.items() if v.cls.role == "trainer")
    main = views[trainers[0]].config.buffer if trainers else next(
        (n for n, v in views.items() if v.cls.role == "buffer"), "")
    facts = {}
    for name, view in views.items():  # actors outside any pipeline (workers) get the main one's
        facts[name] = run_facts(views, tables, _buffer(name, *tables[name]) or main)
        try:
            view.cls.check_facts(view.config, facts[name])
        except ValueError as e:
            raise PlanError(name, str(e)) from None
        except Exception as e:  # a class its check loads (a tokenizer) failed in its own way
            raise PlanError(name, f"checking it against the run's facts raised "
                                  f"{type(e).__name__}: {e}") from None
    return facts


def _check_trainer(name: str, cfg: Any, views: dict[str, ActorView]) -> None:
    """Colocated staleness, the teacher pools, the workers' kernels, the weight-sync placement."""
    buf, buffer = f"[actors.{cfg.buffer}.config]", views[cfg.buffer]
    staleness = buffer.config.max_staleness if buffer.cls.role == "buffer" else 0
    if cfg.mode == "colocated" and staleness != 0:
        raise PlanError(name, f"mode = 'colocated' here needs max_staleness = 0 in {buf} (it is "
                              f"{staleness}): nothing is generated while the trainer trains; set "
                              f"max_staleness = 0 there, or mode = 'decoupled' here")
    pools = [n for n, v in views.items() if v.cls.role == "teacher_pool"
             and v.config.buffer == cfg.buffer]
    if cfg.opd is None and pools:
        raise PlanError(name, f"[actors.{pools[0]}] (a teacher pool) routes samples into {buf}, "
                              f"but opd is not set here: add opd = {{ mode = ..., kl_coef = ... }}"
                              f" here, or remove the teacher pool")
    if cfg.opd is not None and not pools:
        raise PlanError(name, f"opd is set here, but no teacher pool sends its groups to {buf}: "
                              f"add one with buffer = {cfg.buffer!r} and make it the rollout's "
                              f"`sink`, or remove opd")
    for pool in pools:
        _check_pool(name, cfg, f"[actors.{pool}.config]", views[pool].config)
    for w in cfg.workers:
        _check_invariant(name, cfg, w, views[w].config)
    try:
        check_weight_sync_placement(cfg.weight_sync.path, cfg.workers,
                                    [views[w].gpus for w in cfg.workers], views[name].gpus,
                                    cfg.device)
    except ValueError as e:
        raise PlanError(name, str(e)) from None


def _check_pool(name: str, cfg: Any, there: str, pc: Any) -> None:
    """Colocated teachers are the pool's list; teacher servers return what the opd asks for."""
    mine, theirs = (sorted((t.name, t.model, tuple(sorted(t.domains))) for t in specs)
                    for specs in (cfg.teachers, pc.teachers))
    if cfg.teachers and pc.mode != "colocated":
        raise PlanError(name, f"`teachers` here run colocated in the trainer, but {there} has "
                              f"mode = {pc.mode!r}: set mode = 'colocated' there, or remove "
                              f"`teachers` here to use its teacher servers")
    if cfg.teachers and mine != theirs:
        raise PlanError(name, f"`teachers` here and in {there} differ (name, model, domains): "
                              f"here {mine}, there {theirs}: give both the same list")
    if not cfg.teachers and pc.mode != "server":
        raise PlanError(name, f"opd without `teachers` here takes the teacher signal from "
                              f"teacher servers, but {there} has mode = 'colocated': set mode = "
                              f"'server' there, or list the same `teachers` here")
    if not cfg.teachers and (pc.opd.mode, pc.opd.top_k) != (cfg.opd.mode, cfg.opd.top_k):
        raise PlanError(name, f"opd here (mode = {cfg.opd.mode!r}, top_k = {cfg.opd.top_k}) and "
                              f"in {there} (mode = {pc.opd.mode!r}, top_k = {pc.opd.top_k}) "
                              f"differ: set the same opd mode and top_k in both")


def _check_invariant(name: str, cfg: Any, worker: str, there: Any) -> None:
    """`true_on_policy` needs embedded workers with the trainer's flag, dtype and device kind."""
    embedded = _is_embedded_worker(there)
    if cfg.true_on_policy and not embedded:
        raise PlanError(name, f"true_on_policy = true here, but [actors.{worker}] is not an "
                              f"embedded inference worker: other engines' kernels are not this "
                              f"trainer's; use embedded workers, or leave true_on_policy off")
    if embedded and there.true_on_policy != cfg.true_on_policy:
        flags = [str(f).lower() for f in (cfg.true_on_policy, there.true_on_policy)]
        raise PlanError(name, f"true_on_policy = {flags[0]} here but {flags[1]} in "
                              f"[actors.{worker}.config]: set the same value in both (or "
                              f"`true_on_policy` in [rl])")
    if cfg.true_on_policy and (there.dtype, there.device.split(":")[0]) != (
            cfg.dtype, cfg.device.split(":")[0]):
        raise PlanError(name, f"true_on_policy: dtype {cfg.dtype!r} on {cfg.device!r} here but "
                              f"dtype {there.dtype!r} on {there.device!r} in "
                              f"[actors.{worker}.config]; bitwise equality needs both the same")


def _is_embedded_worker(config: Any) -> bool:
    """`config` is an embedded inference worker's (actors/inference_config.py)."""
    return isinstance(config, InferenceWorkerConfig)


def run_facts(views: dict[str, ActorView], tables: Tables, buffer: str) -> RunFacts:
    """The facts of the pipeline of `buffer`."""
    facts = {fact: d[1] for fact in DECIDED_BY if (d := _decider(fact, buffer, tables))}
    for v in views.values():
        if v.cls.role == "teacher_pool" and v.config.buffer == buffer:
            facts["teachers"] = [TeacherFact(t.name, t.model, sorted(t.domains))
                                 for t in v.config.teachers]
        if v.cls.role == "trainer" and v.config.buffer == buffer and v.config.opd is not None:
            facts.update(opd_mode=v.config.opd.mode, opd_top_k=v.config.opd.top_k)
    if isinstance(facts.get("model"), str):  # resolved to a local path at load (models/hub.py)
        facts["vocab_size"] = checkpoint_vocab_size(facts["model"])
    return msgspec.convert(facts, RunFacts)
