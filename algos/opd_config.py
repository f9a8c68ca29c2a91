"""On-policy distillation's settings (`opd`: the trainer's, a teacher pool's, a teacher's own)
and the checks of a teacher's placement (algos/opd.py computes the signals; its docstring says
what each mode does).

A module of its own, free of torch, so that the launcher checks the tables without importing the
tensor functions (tests/test_import_cost.py).
"""

from __future__ import annotations

import math

import msgspec

OPD_MODES = ("sampled", "top_p", "top_k", "full")
TEACHER_LOGIT_MODES = ("top_p", "full")  # need teacher logits: colocated teachers only
SERVER_MODES = ("sampled", "top_k")  # work from teacher server replies (or colocated)
TOP_K_FROM = ("student", "teacher")  # whose top-k is the set of the top_k mode


class OpdConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How one teacher's signal reaches the student (algos/opd.py's docstring)."""

    mode: str = "sampled"  # sampled | top_p | top_k | full
    kl_coef: float = 1.0  # beta: weight of the reverse KL (0: scored and logged, not trained on)
    top_p: float = 1.0  # top_p mode: nucleus mass, the rollout's sampling top_p, in (0, 1]
    top_k: int = 0  # top_k mode: tokens per position (a server's top_logprobs_num)
    # top_k mode: "student" = the top-k of the student's sampling distribution (the source's;
    # colocated teachers only), "teacher" = the teacher's top-k (what a teacher server returns)
    top_k_from: str = "student"
    # renormalise the policy gradient's log-probs (training, proximal, rollout) over the nucleus
    # the rollout recorded for each token (the source's top-p replay); any mode
    top_p_replay: bool = False
    # top_k mode with top_k_from = "teacher", teachers of another vocabulary: weight of the
    # sorted-probability (ULD-style) term at the student tokens that start an aligned span the
    # mapped top-k does not cover (algos/cross_tokenizer.py `sorted_prob_distance`); 0 = off
    uld_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in OPD_MODES:
            raise ValueError(f"opd mode = {self.mode!r}; use one of {OPD_MODES}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p != 1 and self.mode != "top_p":
            raise ValueError(f"top_p = {self.top_p} is only used by mode = 'top_p' (mode is "
                             f"{self.mode!r}); set mode = 'top_p' or remove top_p")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 1 (top_k mode) or absent, got {self.top_k}")
        if self.mode == "top_k" and self.top_k < 1:
            raise ValueError("mode = 'top_k' needs top_k >= 1 (the tokens compared per "
                             "position); set top_k, e.g. top_k = 20")
        if self.top_k and self.mode != "top_k":
            raise ValueError(f"top_k = {self.top_k} is only used by mode = 'top_k' (mode is "
                             f"{self.mode!r}); set mode = 'top_k' or remove top_k")
        if self.top_k_from not in TOP_K_FROM:
            raise ValueError(f"top_k_from = {self.top_k_from!r}; use one of {TOP_K_FROM}")
        if not (math.isfinite(self.uld_coef) and self.uld_coef >= 0):
            raise ValueError(f"uld_coef must be a finite number >= 0, got {self.uld_coef}")
        if self.uld_coef and not (self.mode == "top_k" and self.top_k_from == "teacher"):
            raise ValueError(f"uld_coef = {self.uld_coef} compares the student's distribution "
                             f"with the teacher's top-k, which only mode = 'top_k' with "
                             f"top_k_from = 'teacher' asks for (mode is {self.mode!r}, "
                             f"top_k_from {self.top_k_from!r}); set those or remove uld_coef")
        if self.top_k_from != "student" and self.mode != "top_k":
            raise ValueError(f"top_k_from = {self.top_k_from!r} is only used by mode = 'top_k' "
                             f"(mode is {self.mode!r}); remove it")


def needs_teacher_logits(mode: str, top_k_from: str = "teacher") -> bool:
    """True for modes that need the teacher's full logits (a colocated teacher forward)."""
    if mode not in OPD_MODES:
        raise ValueError(f"opd mode = {mode!r}; use one of {OPD_MODES}")
    return mode in TEACHER_LOGIT_MODES or (mode == "top_k" and top_k_from == "student")


def is_loss_term(mode: str) -> bool:
    """True for the differentiable KL loss modes; False for `sampled` (advantage shaping)."""
    needs_teacher_logits(mode)  # validates the name
    return mode != "sampled"


def check_placement(cfg: OpdConfig, placement: str, teacher: str = "teacher") -> None:
    """Refuse a server-mode teacher whose OPD mode needs logits a server does not return."""
    if placement != "server":
        return
    if cfg.mode == "top_k" and cfg.top_k_from == "student":
        raise ValueError(f"{teacher}: mode = 'top_k' with top_k_from = 'student' (the default: "
                         f"the top-k of the student's sampling distribution) reads the teacher's "
                         f"log-probs at the student's k ids of every position; a teacher server "
                         f"(SGLang's /generate) returns log-probs only for its own top-k "
                         f"(top_logprobs_num) or for the sequence's tokens, not for per-position "
                         f"id lists. Set top_k_from = 'teacher' (the teacher's top-k, what the "
                         f"server returns) or use colocated teachers")
    if needs_teacher_logits(cfg.mode):
        raise ValueError(f"{teacher}: mode = {cfg.mode!r} needs the teacher's logits, which a "
                         f"teacher server does not return; use a colocated teacher or one of "
                         f"the server modes {SERVER_MODES} (top_k with top_k_from = 'teacher')")


CROSS_VOCAB_MODES = SERVER_MODES  # what a teacher of another vocabulary gives, wherever it runs


def check_cross_vocab(cfg: OpdConfig, teacher: str = "teacher") -> None:
    """Refuse a mode a teacher of another vocabulary cannot give: its distribution is over its
    own ids, so only its sampled-token log-probs and its top-k (mapped to student ids by text:
    algos/cross_tokenizer.py) reach the student."""
    if cfg.mode in CROSS_VOCAB_MODES and not (cfg.mode == "top_k"
                                              and cfg.top_k_from == "student"):
        return
    raise ValueError(f"{teacher}: mode = {cfg.mode!r}"
                     f"{' with top_k_from = student' if cfg.mode == 'top_k' else ''} reads the "
                     f"teacher's distribution at the student's token ids, but this teacher has "
                     f"another vocabulary; use mode = 'sampled' (span log-probs) or mode = "
                     f"'top_k' with top_k_from = 'teacher' (its top-k mapped to student ids by "
                     f"token text), docs/mopd.md")
