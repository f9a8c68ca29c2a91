"""Honest endings: what failed in a run, built by the launcher from the metrics stream.

The rollout counts every batch's failed episodes (`rollout/failed`) and, among them, those whose
environment's own code failed (`rollout/failed_env`: reward() or episode() raised, or ran past
`env_timeout_s`), by domain (`rollout/failed/<domain>`); its records carry the first failed
episode of each domain as a sample (text, error, environment, task), and an evaluation's record
carries every response with its status (actors/rollout.py). `Failures.on_record` reads them as
they arrive; a batch reported twice (a restarted rollout redoing it) counts once, its last
report, as an evaluation of one weight version does.

At the end (launch/cluster.py `run_cluster`): a run whose episodes failed in their environment
exits 1 even when every step ran (exit.json's reason and `failures` say what), unless
`[run] tolerate_failures = true`; either way the console gets `summary()`. Episodes whose
generation failed on the workers (a worker killed or restarting: the run recovers from it by
design, bench/chaos.py) are counted and said, and do not change the exit code. A record from a
rollout older than `rollout/failed_env` counts all its failures as the environment's.
"""

from __future__ import annotations

import math
from typing import Any

ERROR_CHARS = 300  # the first error's text in the summary and exit.json, characters


def _count(value: Any) -> int:
    """A published count as an int (0 for a value that is not a finite number >= 0)."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return 0
    return int(value)


class Failures:
    """Failed episodes of a run, from its metrics records."""

    def __init__(self) -> None:
        # (actor, batch) -> (failed, of them the environment's, {domain: failed})
        self.batches: dict[tuple[str, int], tuple[int, int, dict[str, int]]] = {}
        # (actor, weight version) -> (failed, of them the environment's, {domain: failed})
        self.evals: dict[tuple[str, int], tuple[int, int, dict[str, int]]] = {}
        self.first: dict[str, str] | None = None  # the first failed episode seen
        self.first_is_env = False

    def on_record(self, m: Any) -> None:
        values = m.values
        samples = list(getattr(m, "samples", None) or [])
        if "rollout/failed" in values and m.step is not None:
            failed = _count(values["rollout/failed"])
            env = _count(values.get("rollout/failed_env", failed))
            domains = {k[len("rollout/failed/"):]: _count(v) for k, v in values.items()
                       if k.startswith("rollout/failed/")}
            self.batches[(m.actor, m.step)] = (failed, min(env, failed),
                                               {d: n for d, n in domains.items() if n})
        evals = [s for s in samples if getattr(s, "kind", "") == "eval"]
        if evals and m.step is not None:
            bad = [s for s in evals if s.status != "ok"]
            domains: dict[str, int] = {}
            for s in bad:
                domains[s.domain] = domains.get(s.domain, 0) + 1
            self.evals[(m.actor, m.step)] = (len(bad), sum(s.cause != "generation" for s in bad),
                                             domains)
        for s in samples:
            if getattr(s, "status", "ok") == "ok":
                continue
            env = s.cause != "generation"
            if self.first is None or (env and not self.first_is_env):
                self.first_is_env = env
                error = " ".join(s.error.split())  # one line
                self.first = {"kind": s.kind, "domain": s.domain, "env": s.env, "task": s.task,
                              "episode": s.episode, "cause": s.cause or "env",
                              "error": error[-ERROR_CHARS:]}

    def totals(self) -> dict[str, Any]:
        """Counts over the run: failed episodes of training batches and of evaluations, those
        of the environment and those of generation, by domain; the first failure."""
        def add(parts: dict) -> tuple[int, int, dict[str, int]]:
            failed = sum(p[0] for p in parts.values())
            env = sum(p[1] for p in parts.values())
            domains: dict[str, int] = {}
            for p in parts.values():
                for d, n in p[2].items():
                    domains[d] = domains.get(d, 0) + n
            return failed, env, dict(sorted(domains.items()))
        train, train_env, train_domains = add(self.batches)
        ev, ev_env, ev_domains = add(self.evals)
        return {"episodes_failed": train + ev, "env_failed": train_env + ev_env,
                "generation_failed": train + ev - train_env - ev_env,
                "train_failed": train, "eval_failed": ev, "by_domain": train_domains,
                "eval_by_domain": ev_domains, "first": self.first}

    def env_failed(self) -> int:
        return self.totals()["env_failed"]

    def summary(self) -> str | None:
        """One message for the console (None when nothing failed)."""
        t = self.totals()
        if not t["episodes_failed"]:
            return None
        where = ", ".join(f"{d} {n}" for d, n in t["by_domain"].items())
        parts = [f"failures: {t['episodes_failed']} episode(s) failed"]
        counts = []
        if t["env_failed"]:
            counts.append(f"{t['env_failed']} in their environment")
        if t["generation_failed"]:
            counts.append(f"{t['generation_failed']} in generation (workers)")
        parts.append(f"({', '.join(counts)});")
        parts.append(f"{t['train_failed']} in training batches" + (f" ({where})" if where
                                                                    else ""))
        if t["eval_failed"]:
            ev = ", ".join(f"{d} {n}" for d, n in t["eval_by_domain"].items())
            parts.append(f"and {t['eval_failed']} in evaluations ({ev})")
        text = " ".join(parts)
        first = t["first"]
        if first:
            task = f" task {first['task']!r}" if first["task"] else ""
            env = f"{first['env']}, " if first["env"] else ""
            episode = f" episode {first['episode']}" if first["episode"] else ""
            text += (f"; first: {env}{first['domain']}{task} ({first['kind']}{episode}): "
                     f"{first['error'] or '(no error text)'}")
        return text
