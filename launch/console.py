"""The launcher's console: a few lines that tell the run's story, from the metrics stream.

Every metrics record goes to the sinks (launch/sinks.py); the console gets, per actor, at most one
progress line every `[run] progress_interval_s` (the last step of a run always), and always:
- every evaluation (`eval/<domain>` from the rollout, keyed by the weight version it scored;
  `final_eval/<domain>` from the trainer after the last step, unless the line before said it);
- a warning when a domain's eval answers collapse (`collapse`: one answer is more than
  COLLAPSE_SHARE of the eval's responses, or their entropy is under COLLAPSE_ENTROPY of its
  maximum), naming the domain, the answer and how many responses it is; said when it starts
  and when the answer changes, not at every eval;
- every `[run] show_samples_every` rollout batches (0 = never), one sample per domain of the
  batch (prompt -> response, reward, weight version), from the records' `samples`;
- once, why `train/clipfrac` and `train/ppo_kl` are 0 when they are 0 by construction (they are
  then left out of the trainer's lines).

Progress lines by kind of record:
- trainer steps: every domain's reward, loss, grad norm, entropy, train-rollout log-prob
  difference, step time with its wait / train / weight-sync parts; with distillation the
  distillation KL (`opd/reverse_kl`) and each teacher's (`opd/<teacher>/reverse_kl`), and the
  loss only when it is not 0 (a pure distillation run has no policy-gradient loss: it is 0);
- rollout batches: every domain's reward, failed episodes, tokens/s, the trainer version;
- anything else: its first `GENERIC_VALUES` values (counts of failures and drops only when they
  are not 0).

Width: every physical line fits `LINE` (80) columns with the launcher's `HH:MM:SS ` stamp: one
message is one `say` call whose text may hold several lines, the later ones indented by
`INDENT` (so a log reader keeps a message together); a line breaks between its fields, never
inside one, and a field wider than a line (a path) stands alone on its own.

Invariant: formatting never raises on a record of unexpected shape (a value that is not a number
is printed as it is, a text is shown through repr(), so control characters cannot reach the
terminal); nothing here blocks the stream.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable, Iterable

GENERIC_VALUES = 6
QUIET_WHEN_ZERO = ("dropped", "failed", "fallback", "error", "retries", "restarts")
ZERO_BY_CONSTRUCTION = (
    "train/clipfrac and train/ppo_kl are 0 by construction here: each batch gets one optimizer "
    "step and its old log-probs are recomputed by the very weights being trained, so every "
    "ratio is 1 (nothing to clip), and the whitened advantages have mean 0, so the loss is ~0 "
    "while its gradient is not; they are left out of these lines until they move (with "
    "mismatch.bypass = true the ratio is taken against the rollout's log-probs instead)")

LINE = 80  # columns of a console line
STAMP = 9  # the launcher's "HH:MM:SS " before the first line of a message
INDENT = " " * (STAMP + 2)  # the later lines of a message
# collapse of a domain's eval answers (greedy decoding of different tasks should not give one
# answer): one answer (stripped of surrounding white space) is more than COLLAPSE_SHARE of the
# eval's successful responses, or the entropy of the answers is below COLLAPSE_ENTROPY of its
# maximum (log2 of their number: a few answers share them all); judged from COLLAPSE_MIN
# responses up (fewer say little). A domain whose tasks really share one answer (yes/no) trips
# it by design: the warning names the answer so a reader can tell.
COLLAPSE_SHARE = 0.5
COLLAPSE_ENTROPY = 0.2
COLLAPSE_MIN = 8


def fmt(value: Any) -> str:
    """A number in few columns: a whole one (a count) as an integer, one of 1000 or more
    without decimals, else 3 significant digits; anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if value == 0:
        return "0"
    if math.isfinite(value) and abs(value) < 1e15 and (value == int(value) or abs(value) >= 1e3):
        return f"{value:.0f}"
    return f"{value:.3g}"


def by_prefix(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """`{"<prefix>math": 0.5, ...}` -> `{"math": 0.5, ...}`, in sorted order."""
    return {k[len(prefix):]: values[k] for k in sorted(values) if k.startswith(prefix)}


def domains(values: dict[str, Any]) -> list[str]:
    return [f"{d}={fmt(v)}" for d, v in values.items()]


def fit(parts: Iterable[str | list[str]], width: int = LINE) -> str:
    """The parts joined by spaces into lines that fit `width` columns: the first after the
    `STAMP`, the others after `INDENT`, joined by newlines. A line breaks between parts only
    (a part wider than a line has a line of its own); a group (a list of parts: `reward
    math=.. reverse=..`) starts a new line rather than break, unless it is wider than a line."""
    lines: list[str] = []
    line = ""

    def room() -> int:
        return width - (STAMP if not lines else len(INDENT))

    def add(part: str) -> None:
        nonlocal line
        if line and len(line) + 1 + len(part) > room():
            lines.append(line)
            line = part
        else:
            line = f"{line} {part}" if line else part

    for part in parts:
        if isinstance(part, list):
            whole = " ".join(p for p in part if p)
            if line and len(line) + 1 + len(whole) > room() and len(whole) <= width - len(
                    INDENT):
                lines.append(line)
                line = ""
            for p in part if len(whole) > width - len(INDENT) else [whole]:
                add(p)
        elif part:
            add(part)
    lines.append(line)
    return f"\n{INDENT}".join(lines)


def wrap(text: str, width: int = LINE) -> str:
    """Prose in lines of `width` columns (fit() over its words)."""
    return fit(text.split(" "), width)


def short(text: Any, room: int) -> str:
    """repr() of `text` (control characters escaped) in at most `room` columns: cut, with
    "..." at the cut."""
    r = repr(text if isinstance(text, str) else str(text))
    return r if len(r) <= room else r[:max(1, room - 3)] + "..."


def sample_line(s: Any, room: int) -> str:
    """`domain: 'prompt' -> 'response' (reward 1, v3)` in `room` columns, the prompt given at
    most a third of what the two texts share; a failed episode: `domain: 'prompt' failed:
    <the last line of its error>`."""
    head = f"{str(getattr(s, 'domain', ''))[:20]}: "
    status = str(getattr(s, "status", "ok"))
    if status != "ok":
        error = str(getattr(s, "error", "")).strip().splitlines()
        prompt = short(getattr(s, "prompt", ""), 24)
        text = f"{head}{prompt} {status}: {error[-1].strip() if error else '?'}"
        return text if len(text) <= room else text[:room - 3] + "..."
    tail = f" (reward {fmt(getattr(s, 'reward', 0.0))}, v{getattr(s, 'weight_version', 0)})"
    texts = room - len(head) - len(tail) - len(" -> ")
    prompt = short(getattr(s, "prompt", ""), max(8, texts // 3))
    response = short(getattr(s, "response", ""), max(8, texts - len(prompt)))
    return f"{head}{prompt} -> {response}{tail}"


def collapse(responses: list[str]) -> tuple[str, int, float] | None:
    """(the most common answer, how many responses it is, the answers' entropy as a share of
    its maximum) when the responses collapsed (see COLLAPSE_*), else None."""
    n = len(responses)
    if n < COLLAPSE_MIN:
        return None
    counts = collections.Counter(r.strip() for r in responses)
    answer, top = counts.most_common(1)[0]
    entropy = sum(c / n * math.log2(n / c) for c in counts.values())
    share = entropy / math.log2(n)
    if top > COLLAPSE_SHARE * n or share < COLLAPSE_ENTROPY:
        return answer, top, share
    return None


class Story:
    """Turns metrics records into console messages (`say`, one call per message)."""

    def __init__(self, say: Callable[[str], None], interval_s: float,
                 show_samples_every: int = 0):
        self.say, self.interval_s = say, interval_s
        self.show_samples_every = show_samples_every
        self.last: dict[str, float] = {}
        self.explained_zero = False
        self.last_eval: tuple[int | None, dict[str, Any]] | None = None
        self.collapsed: dict[tuple[str, str], str] = {}  # (actor, domain) -> answer said

    def on_record(self, m: Any) -> None:
        values = dict(m.values)
        samples = list(getattr(m, "samples", None) or [])
        evals = by_prefix(values, "eval/")
        final = by_prefix(values, "final_eval/")
        if evals:
            self.say(fit([f"{m.actor}: eval of weight version {m.step}:", domains(evals)]))
            self.last_eval = (m.step, evals)
        if final and self.last_eval != (m.step, final):  # else the line above said it
            self.say(fit([f"{m.actor}: final eval at step {m.step}:", domains(final)]))
        if samples:
            self.check_collapse(m, samples)
        if not (evals or final or m.step is None):
            self.progress(m, values)
        if samples:
            self.show_samples(m, samples)

    def progress(self, m: Any, values: dict[str, Any]) -> None:
        """The actor's progress line, at most one per `interval_s` (its last step always)."""
        now = time.monotonic()
        last_step = m.total_steps is not None and m.step >= m.total_steps
        if now - self.last.get(m.actor, -1e9) < self.interval_s and not last_step:
            return
        self.last[m.actor] = now
        total = f"/{m.total_steps}" if m.total_steps is not None else ""
        if "train/loss" in values:
            self.say(fit([f"{m.actor}: step {m.step}{total}", *self.trainer_parts(values)]))
        elif any(k.startswith("rollout/reward/") for k in values):
            self.say(fit([f"{m.actor}: batch {m.step}", *self.rollout_parts(values)]))
        else:
            self.say(fit([f"{m.actor}: step {m.step}{total}",
                          *self.generic_parts(m.actor, values)]))

    def show_samples(self, m: Any, samples: list) -> None:
        """Every `show_samples_every` rollout batches: one sample per domain, a line each."""
        every = self.show_samples_every
        if every <= 0 or m.step is None or m.step % every:
            return
        first: dict[str, Any] = {}
        for s in samples:
            if getattr(s, "kind", "") != "rollout":
                continue
            domain = str(getattr(s, "domain", ""))
            if domain not in first or (first[domain].status != "ok" and s.status == "ok"):
                first[domain] = s
        if first:
            room = LINE - len(INDENT)
            self.say("\n".join([f"{m.actor}: samples of batch {m.step}:"] + [
                INDENT + sample_line(first[d], room) for d in sorted(first)]))

    def check_collapse(self, m: Any, samples: list) -> None:
        """An evaluation's successful responses per domain: a warning when they collapsed
        (COLLAPSE_*), once per (actor, domain) until its answer changes or it recovers."""
        per: dict[str, list[str]] = {}
        for s in samples:
            if getattr(s, "kind", "") == "eval" and getattr(s, "status", "") == "ok":
                per.setdefault(str(s.domain), []).append(str(s.response))
        for domain, responses in sorted(per.items()):
            found = collapse(responses)
            key = (m.actor, domain)
            if found is None:
                self.collapsed.pop(key, None)
                continue
            answer, count, share = found
            if self.collapsed.get(key) == answer:
                continue
            self.collapsed[key] = answer
            self.say(wrap(f"warning: {domain!r} answers collapsed at weight version {m.step}: "
                          f"{count} of its {len(responses)} eval responses are "
                          f"{short(answer, 40)} (answer entropy {share:.0%} of its maximum); "
                          f"the policy may have collapsed: look at "
                          f"samples/eval.jsonl"))

    @staticmethod
    def generic_parts(actor: str, values: dict[str, Any]) -> list[str]:
        """The first GENERIC_VALUES values; counts of things that went wrong only when not 0,
        a key's `<actor>/` prefix left out."""
        shown = [(k.removeprefix(f"{actor}/"), v) for k, v in values.items()
                 if v != 0 or not any(w in k for w in QUIET_WHEN_ZERO)]
        return [f"{k}={fmt(v)}" for k, v in shown[:GENERIC_VALUES]]

    def trainer_parts(self, v: dict[str, Any]) -> list[str | list[str]]:
        parts = []
        rewards = by_prefix(v, "reward/")
        if rewards:
            parts.append(["reward", *domains(rewards)])
        teachers = {k[4:-len("/reverse_kl")]: v[k] for k in sorted(v)
                    if k.startswith("opd/") and k.endswith("/reverse_kl") and k.count("/") == 2}
        zero = v.get("train/clipfrac") == 0 and v.get("train/ppo_kl") == 0
        if zero and not self.explained_zero and not teachers:  # (distillation: no advantages)
            self.explained_zero = True
            self.say(wrap(f"note: {ZERO_BY_CONSTRUCTION}"))
        keys = ["train/loss", "train/grad_norm", "train/entropy", "train/logprob_abs_diff",
                "train/kl_loss", "train/value_loss"]
        pure = bool(teachers) and v.get("train/loss") == 0
        if pure:  # pure distillation: no policy-gradient loss, its clip statistics say nothing
            keys.remove("train/loss")
        if not zero and not pure:
            keys[1:1] = ["train/clipfrac", "train/ppo_kl"]
        names = {"train/grad_norm": "grad_norm", "train/logprob_abs_diff": "lp_diff",
                 "train/entropy": "entropy"}
        if teachers:  # distillation first: what such a run learns from
            whole = [f"distill_kl={fmt(v['opd/reverse_kl'])}"] if "opd/reverse_kl" in v else []
            parts.append([*whole, "kl", *domains(teachers)])
        parts += [f"{names.get(k, k.split('/', 1)[1])}={fmt(v[k])}" for k in keys if k in v]
        if "time/step_s" in v:
            times = [f"{name} {fmt(v[k])}" for name, k in (
                ("wait", "time/wait_batch_s"), ("train", "time/train_s"),
                ("sync", "time/weight_sync_s")) if k in v]
            parts.append(f"step_s={fmt(v['time/step_s'])} ({', '.join(times)})")
        return parts

    @staticmethod
    def rollout_parts(v: dict[str, Any]) -> list[str | list[str]]:
        parts: list[str | list[str]] = [["reward", *domains(by_prefix(v, "rollout/reward/"))]]
        if v.get("rollout/failed"):
            parts.append(f"failed={fmt(v['rollout/failed'])}")
        for key, name in (("rollout/tokens_per_s", "tok/s"),
                          ("rollout/trainer_version", "trainer_version")):
            if key in v:
                parts.append(f"{name}={fmt(v[key])}")
        return parts