"""The teacher pool as the launcher sees it (actors/teacher_pool.py is the actor): its settings
and the checks the launcher runs on a plan (runtime/loading.py `import_actor`, plan side)."""

from __future__ import annotations

from typing import Literal

import msgspec

from algos.opd_config import OpdConfig, check_placement
from logic.teachers import (
    CrossVocab,
    TeacherSpec,
    check_vocab,
    route_table,
    same_vocab,
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
        own tokenizer and is served (scored across vocabularies); teachers score at the run's
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
    (`tokenizer = "student"`, the default), or one that is colocated (the trainer runs
    teachers on the student's token ids)."""
    if not facts.model:
        raise ValueError("no trainer on this pool's buffer decides the student model, whose "
                         f"tokenizer the teachers are checked against: add a trainer with "
                         f"buffer = {config.buffer!r}")
    student = load_tokenizer(facts.model)
    out: dict[str, CrossVocab] = {}
    for t in config.teachers:
        teacher = load_tokenizer(tokenizer_source(t))
        if same_vocab(student, teacher):
            continue
        if t.tokenizer == "student":
            check_vocab(student, teacher, t.name)  # raises, naming the differences
        if config.mode != "server":
            raise ValueError(f"teacher {t.name!r} has a tokenizer of its own (tokenizer = "
                             f"{t.tokenizer!r}) that differs from the student's; teachers of "
                             f"another vocabulary are scored by a teacher server: set the "
                             f"teacher mode to \"server\" ([rl] teacher_mode = \"server\" "
                             f"with the teacher's `worker` or `url`)")
        if not getattr(teacher, "is_fast", False):
            raise ValueError(f"teacher {t.name!r}: its tokenizer gives no character offsets "
                             "(a fast, tokenizers-library tokenizer is needed to align it with "
                             "the student's)")
        out[t.name] = CrossVocab(student, teacher)
    return out
