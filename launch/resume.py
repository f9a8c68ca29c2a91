"""`python -m launch.cluster HOSTS.toml --resume RUN_DIR`: what a resumed run may change.

A resumed run continues the run recorded in RUN_DIR/config.json from its latest checkpoint, with
the same settings: the `--set` options recorded there are applied again (given ones over them),
and the config the command gives (its file, with every `--set`) must resolve to the recorded one
except for how far the run trains (`num_steps`, e.g. `--set rl.num_steps=400`) and how the same
computation is laid out, scheduled and watched (RESUMABLE_KEYS, RESUMABLE_RUN: parallelism,
devices, hosts, weight sync, micro-batches, staleness, [run]'s supervision fields); these are
said when the run starts. Any other change is refused with the list of what changed, unless
`--allow-changes` is given. A run already
complete (its primary actor finished and, for a trainer, its last checkpoint is at
`num_steps`) has nothing to resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


# what a resumed run may change by itself (each change is said when it starts): how far it
# trains, and how the same computation is laid out, scheduled, saved, watched and supervised.
# Anything else (the model, the data, the algorithm, the optimizer, the sampling) needs
# --allow-changes.
RESUMABLE_KEYS = frozenset({  # at any depth: the field itself and everything below it
    "num_steps", "parallel", "device", "host", "hosts", "threads", "env", "restart",
    "start_timeout_s", "stop_timeout_s", "weight_sync", "micro_batches", "micro_batch_size",
    "max_staleness", "save_every", "eval_every", "keys_dir"})
RESUMABLE_RUN = frozenset({
    "name", "dir", "progress_interval_s", "show_samples_every", "stall_report_s", "plots",
    "tolerate_failures", "ready_timeout_s", "shutdown_timeout_s", "term_timeout_s",
    "heartbeat_interval_s", "heartbeat_timeout_s", "request_retry_s", "sinks", "wandb"})
NOT_SETTINGS = frozenset({"source", "start_order", "overrides"})  # config.json's own keys
SHOWN = 8  # differences listed at most


def resumable(keys: tuple[str, ...]) -> bool:
    """Whether the setting at the dotted path `keys` may differ in a resumed run by itself."""
    return any(k in RESUMABLE_KEYS for k in keys) or (
        len(keys) > 1 and keys[0] == "run" and keys[1] in RESUMABLE_RUN)


def recorded_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.json; ConfigError when it cannot be read."""
    try:
        doc = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume {run_dir}: cannot read its config.json ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--resume {run_dir}: its config.json is not a JSON object")
    return doc


def resume_overrides(run_dir: Path, given: list[str]) -> list[str]:
    """The `--set` options of a resumed run: the ones recorded in its config.json, with the
    given ones over them (what they may change is checked on the whole config:
    check_same_run)."""
    recorded = recorded_config(run_dir).get("overrides", [])
    merged = {tuple(o.keys): o for o in parse_overrides(recorded)}
    merged.update({tuple(o.keys): o for o in parse_overrides(given)})
    return [o.text for o in merged.values()]


Change = tuple[str, Any, Any]  # dotted path, recorded value, given value


def differences(old: Any, new: Any, at: tuple[str, ...] = ()) -> list[Change]:
    """Every leaf that differs between two config documents; lists compare whole (a list of
    tables is one setting), a table on one side only is one difference."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[Change] = []
        for key in sorted(set(old) | set(new), key=str):
            if not at and key in NOT_SETTINGS:
                continue
            out += differences(old.get(key, ABSENT), new.get(key, ABSENT), (*at, str(key)))
        return out
    return [] if old == new else [(".".join(at), old, new)]


ABSENT = object()


def describe(changes: list[Change]) -> str:
    """'path: old -> new; ...' for at most SHOWN changes (long values shortened)."""
    def show(v: Any) -> str:
        text = "(absent)" if v is ABSENT else json.dumps(v)
        if len(text) <= 60:
            return text
        return "..." + text[-57:] if isinstance(v, str) else text[:57] + "..."  # a path's end

    more = f"; and {len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
    return "; ".join(f"{p}: {show(a)} -> {show(b)}" for p, a, b in changes[:SHOWN]) + more


def check_same_run(run_dir: Path, resolved: dict[str, Any], allow_changes: bool = False
                   ) -> list[Change]:
    """The changes of the config to resume with (`resolved`, as config.json records it) from
    the run's own: returned when each is resumable (RESUMABLE_*) or `allow_changes`, else
    ConfigError listing the others."""
    changes = [c for c in differences(recorded_config(run_dir), json.loads(json.dumps(resolved)))
               if not (c[0] == "security.keys_dir" and c[2] == "")]  # the run's own keys: new
    refused = [c for c in changes if not resumable(tuple(c[0].split(".")))]
    if refused and not allow_changes:
        raise ConfigError(
            f"--resume {run_dir}: this config is not the run's ({describe(refused)}; recorded "
            f"-> given); use the run's own file and --set options (its config.json has every "
            f"setting), add --allow-changes to continue the run with these changes anyway, or "
            f"start a new run (without --resume)")
    return changes
