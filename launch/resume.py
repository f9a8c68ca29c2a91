"""`python -m launch.cluster HOSTS.toml --resume RUN_DIR`: what a resumed run may change.

A resumed run continues the run recorded in RUN_DIR/config.json from its latest checkpoint. The
`--set` options recorded there are applied again when none are given; a run already complete
(its primary actor finished and, for a trainer, its last checkpoint is at `num_steps`) has
nothing to resume.
"""

from __future__ import annotations

import json
from pathlib import Path

from launch.config import ClusterConfig, ConfigError, parse_overrides


def already_complete(run_dir: Path, cfg: ClusterConfig) -> str | None:
    """Why the run in `run_dir` has nothing left to do, or None: its primary actor completed
    (exit.json) and, when that actor counts `num_steps` (the trainer), the latest checkpoint is
    at or past the configured number (a file that raises it continues the run)."""
    try:
        done = json.loads((run_dir / "exit.json").read_text())
    except (OSError, ValueError):
        return None
    name = done.get("completed") if isinstance(done, dict) and done.get("exit_code") == 0 \
        else None
    if not isinstance(name, str) or name not in cfg.actors:
        return None
    steps = cfg.actors[name].config.get("num_steps")
    if not isinstance(steps, int):
        return f"{name} finished; exit.json"
    saved = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")
             if p.name[5:].isdigit()]
    if not saved or max(saved) < steps:
        return None
    return f"{name} finished at step {max(saved)} of num_steps = {steps}"


def resume_overrides(run_dir: Path, given: list[str]) -> list[str]:
    """The `--set` options of a resumed run: the ones recorded in its config.json, when none
    or the same are given; ConfigError for a different set."""
    try:
        recorded = json.loads((run_dir / "config.json").read_text()).get("overrides", [])
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume {run_dir}: cannot read its config.json ({e})") from None
    if not given:
        return list(recorded)
    as_set = {tuple(o.keys): o.value for o in parse_overrides(given)}
    if as_set != {tuple(o.keys): o.value for o in parse_overrides(recorded)}:
        was = " ".join(f"--set {o}" for o in recorded) or "no --set"
        now = " ".join(f"--set {o}" for o in given)
        raise ConfigError(f"--resume {run_dir}: the run was started with {was}, this command "
                          f"gives {now}; a resumed run keeps its settings: give the same --set "
                          f"options, or none (the recorded ones are applied), or start a new "
                          f"run (without --resume) to change them")
    return list(given)


