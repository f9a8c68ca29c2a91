"""The teacher pool as the launcher sees it (actors/teacher_pool.py is the actor): its settings
and the checks the launcher runs on a plan (runtime/loading.py `import_actor`, plan side)."""

from __future__ import annotations

from typing import Literal

import msgspec

from algos.opd_config import OpdConfig, check_placement
from logic.teachers import (
    CrossVocab,
    TeacherSpec,
    cross_vocab,
    route_table,
    tokenizer_source,
)
from models.names import check_model_path
from models.tokenizer_load import load_tokenizer
from runtime.actor import Actor
from runtime.facts import RunFacts


class TeacherPoolConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the teacher pool."""

    teachers: list[TeacherSpec]  # the registry
    default_teacher: str = ""  # for domains no teacher claims ("" = such samples get none)
    mode: Literal["server", "colocated"] = "colocated"
    opd: OpdConfig = OpdConfig()  # must match the trainer's (top_k decides what servers return)
    buffer: str = "buffer"  # where routed (and scored) groups go
    request_timeout_s: float = 60.0  # one scoring request
    max_retries: int = 3  # per request, then the samples are marked failed
    max_batch: int = 64  # samples per scoring request


class TeacherPoolPlan(Actor):
    """What the launcher checks of a teacher pool: its routing, placement and teachers, their
    vocabularies against the run's model, its peers."""

    Config = TeacherPoolConfig
    role = "teacher_pool"

    @classmethod
    def check_config(cls, config: TeacherPoolConfig) -> None:
        route_table(config.teachers, config.default_teacher)
        for t in config.teachers:
            if t.opd is not None and config.mode == "server":
                raise ValueError(f"teacher {t.name!r} sets its own opd, which colocated teachers "
                                 "support; in server mode every teacher uses the run's opd")
            check_placement(config.opd, config.mode, t.name)
            check_model_path(t.model)
            if config.mode == "server" and not (t.worker or t.url):
                raise ValueError(f"teacher {t.name!r}: server mode needs `worker` (a peer name) "
                                 "or `url` (a teacher server)")

    @classmethod
    def check_facts(cls, config: TeacherPoolConfig, facts: RunFacts) -> None:
        """Every teacher shares the student's (the run's model's) vocabulary, or declares its
        own tokenizer (scored across vocabularies); teachers score at the run's
        sampling temperature."""
        cross_teachers(config, facts)

    @classmethod
    def peers(cls, config: TeacherPoolConfig) -> dict[str, str]:
        """Its buffer, and in server mode the teachers' `worker`s."""
        served = config.teachers if config.mode == "server" else []
        return {"buffer": config.buffer,
                **{f"teachers[{t.name!r}].worker": t.worker for t in served}}


def cross_teachers(config: TeacherPoolConfig, facts: RunFacts) -> dict[str, CrossVocab]:
    """{teacher: CrossVocab} for the teachers whose tokenizer differs from the student's (the
    run's model's); ValueError for one declared with the student's tokenizer
    (`tokenizer = "student"`, the default) or one whose tokenizer gives no offsets
    (logic/teachers.py `cross_vocab`). Colocated teachers are scored across vocabularies by
    the trainer, which checks them again against its own model."""
    if not facts.model:
        raise ValueError("no trainer on this pool's buffer decides the student model, whose "
                         f"tokenizer the teachers are checked against: add a trainer with "
                         f"buffer = {config.buffer!r}")
    student = load_tokenizer(facts.model)
    out: dict[str, CrossVocab] = {}
    for t in config.teachers:
        cross = cross_vocab(student, load_tokenizer(tokenizer_source(t)), t)
        if cross is not None:
            out[t.name] = cross
    return out
