"""The launcher's console: a few lines that tell the run's story, from the metrics stream.

Every metrics record goes to the sinks (launch/sinks.py); the console gets, per actor, at most one
progress line every `[run] progress_interval_s` (the last step of a run always), and always:
- every evaluation (`eval/<domain>` from the rollout, keyed by the weight version it scored;
  `final_eval/<domain>` from the trainer after the last step, unless the line before said it);
- once, why `train/clipfrac` and `train/ppo_kl` are 0 when they are 0 by construction (they are
  then left out of the trainer's lines).

Progress lines by kind of record:
- trainer steps: every domain's reward, loss, grad norm, entropy, train-rollout log-prob
  difference, step time with its wait / train / weight-sync parts;
- rollout batches: every domain's reward, failed episodes, tokens/s, the trainer version;
- anything else: its first `GENERIC_VALUES` values (counts of failures and drops only when they
  are not 0).

Invariant: formatting never raises on a record of unexpected shape (a value that is not a number
is printed as it is); nothing here blocks the stream.
"""

from __future__ import annotations

import time
from typing import Any, Callable

GENERIC_VALUES = 6
QUIET_WHEN_ZERO = ("dropped", "failed", "fallback", "error", "retries", "restarts")
ZERO_BY_CONSTRUCTION = (
    "train/clipfrac and train/ppo_kl are 0 by construction here: each batch gets one optimizer "
    "step and its old log-probs are recomputed by the very weights being trained, so every "
    "ratio is 1 (nothing to clip), and the whitened advantages have mean 0, so the loss is ~0 "
    "while its gradient is not; they are left out of these lines until they move (with "
    "mismatch.bypass = true the ratio is taken against the rollout's log-probs instead)")


def fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def by_prefix(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """`{"<prefix>math": 0.5, ...}` -> `{"math": 0.5, ...}`, in sorted order."""
    return {k[len(prefix):]: values[k] for k in sorted(values) if k.startswith(prefix)}


def domains(values: dict[str, Any]) -> str:
    return " ".join(f"{d}={fmt(v)}" for d, v in values.items())


class Story:
    """Turns metrics records into console lines (`say`)."""

    def __init__(self, say: Callable[[str], None], interval_s: float):
        self.say, self.interval_s = say, interval_s
        self.last: dict[str, float] = {}
        self.explained_zero = False
        self.last_eval: tuple[int | None, dict[str, Any]] | None = None

    def on_record(self, m: Any) -> None:
        values = dict(m.values)
        evals = by_prefix(values, "eval/")
        final = by_prefix(values, "final_eval/")
        if evals:
            self.say(f"{m.actor}: eval of weight version {m.step}: {domains(evals)}")
            self.last_eval = (m.step, evals)
        if final and self.last_eval != (m.step, final):  # else the line above said it
            self.say(f"{m.actor}: final eval at step {m.step}: {domains(final)}")
        if evals or final or m.step is None:
            return
        now = time.monotonic()
        last_step = m.total_steps is not None and m.step >= m.total_steps
        if now - self.last.get(m.actor, -1e9) < self.interval_s and not last_step:
            return
        self.last[m.actor] = now
        total = f"/{m.total_steps}" if m.total_steps is not None else ""
        if "train/loss" in values:
            self.say(f"{m.actor}: step {m.step}{total} {self.trainer_line(values)}")
        elif any(k.startswith("rollout/reward/") for k in values):
            self.say(f"{m.actor}: batch {m.step} {self.rollout_line(values)}")
        else:
            self.say(f"{m.actor}: step {m.step}{total} {self.generic_line(m.actor, values)}")

    @staticmethod
    def generic_line(actor: str, values: dict[str, Any]) -> str:
        """The first GENERIC_VALUES values; counts of things that went wrong only when not 0,
        a key's `<actor>/` prefix left out."""
        shown = [(k.removeprefix(f"{actor}/"), v) for k, v in values.items()
                 if v != 0 or not any(w in k for w in QUIET_WHEN_ZERO)]
        return " ".join(f"{k}={fmt(v)}" for k, v in shown[:GENERIC_VALUES])

    def trainer_line(self, v: dict[str, Any]) -> str:
        parts = []
        rewards = by_prefix(v, "reward/")
        if rewards:
            parts.append(f"reward {domains(rewards)}")
        zero = v.get("train/clipfrac") == 0 and v.get("train/ppo_kl") == 0
        if zero and not self.explained_zero:
            self.explained_zero = True
            self.say(f"note: {ZERO_BY_CONSTRUCTION}")
        keys = ["train/loss", "train/grad_norm", "train/entropy", "train/logprob_abs_diff",
                "train/kl_loss", "train/value_loss"]
        if not zero:
            keys[1:1] = ["train/clipfrac", "train/ppo_kl"]
        parts += [f"{k.split('/', 1)[1]}={fmt(v[k])}" for k in keys if k in v]
        opd = sorted(k for k in v if k.startswith("opd/") and k.endswith("/reverse_kl"))
        parts += [f"{k[4:]}={fmt(v[k])}" for k in opd]
        if "time/step_s" in v:
            times = [f"{name} {fmt(v[k])}" for name, k in (
                ("wait", "time/wait_batch_s"), ("train", "time/train_s"),
                ("sync", "time/weight_sync_s")) if k in v]
            parts.append(f"step_s={fmt(v['time/step_s'])} ({', '.join(times)})")
        return " ".join(parts)

    @staticmethod
    def rollout_line(v: dict[str, Any]) -> str:
        parts = [f"reward {domains(by_prefix(v, 'rollout/reward/'))}"]
        if v.get("rollout/failed"):
            parts.append(f"failed={fmt(v['rollout/failed'])}")
        for key, name in (("rollout/tokens_per_s", "tok/s"),
                          ("rollout/trainer_version", "trainer_version")):
            if key in v:
                parts.append(f"{name}={fmt(v[key])}")
        return " ".join(parts)
