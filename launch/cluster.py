"""`python -m launch.cluster HOSTS.toml`: run a cluster of actors and supervise it.

Exit codes (exit.json holds the same code, the reason and, with `failures`, what failed):
- 0: a primary actor completed and no episode failed in its environment (or some did and
  `[run] tolerate_failures = true`: the summary of what failed is printed all the same);
- 1: an actor failed past its restart budget or never became READY (its error is printed), or
  the run completed but episodes failed in their environment (an env's reward() or episode()
  raised or timed out, in training batches or evaluations): a summary line says how many, by
  domain, and the first error with its environment and task (launch/endings.py); episodes
  whose generation failed on the workers are said and do not count;
- 2: a bad hosts.toml or command line, or a metrics sink that cannot be opened (nothing was
  started);
- 130 on SIGINT (Ctrl-C) and 143 on SIGTERM, after an orderly stop of everything (the run is
  unfinished: the launcher prints the `--resume` command that continues it).

Overrides: `--set PATH=VALUE` (repeatable) sets one value of the hosts.toml document before it
is checked: PATH is dotted (`actors.trainer.config.optimizer.lr`), VALUE is read as a TOML value
(`16`, `3e-5`, `true`, `[1, 2]`, `'"text"'`; a bare word that is not TOML is a string). A table
missing on the way is created only where the schema has one; an unknown field is an error naming
the `--set`. The overrides are recorded in the run directory's config.json; `--resume RUN_DIR`
applies the recorded ones again, given ones over them, and refuses a config that is not the
run's beyond num_steps, the layout and [run]'s supervision fields, listing what changed
(launch/resume.py; `--allow-changes` continues anyway).

Engine options pass through natively (runtime/passthrough.py, `--help` lists the prefixes):
`--<prefix>-<option> [value]` lands in the table of that name (`sglang`, `router`, ...) of every
actor that has one, over the hosts.toml values (e.g.
`--sglang-mem-fraction-static 0.8` -> sglang = { mem_fraction_static = 0.8 }; a flag without a
value is true; a repeated option collects a list). Give the hosts file first (or write
`--sglang-flag=true`), since a flag takes the next non-option token as its value.

The run directory holds config.json (the resolved config, pass-through tables merged in, the
`--set` overrides under "overrides"),
endpoints.json (where the supervisor and metrics stream are), metrics.jsonl (every metrics
record the launcher received; `[run] sinks` adds tensorboard/ and wandb/, launch/sinks.py),
samples/rollout.jsonl and samples/eval.jsonl (episodes as text: a few of every rollout batch,
every evaluation response),
logs/<actor>.log, specs/<actor>.json and, at the end, exit.json (exit code and shutdown step of
every actor) and plots/*.png (`[run] plots`, launch/plot.py; a failure there is only said).

Several hosts (`[[hosts]] exec`, or `hosts = "slurm"`; docs/multihost.md): the launcher starts one
agent per remote host (launch/agent.py), checks that host's code and environment against its own
before starting any actor, and runs every socket on tcp:// with CURVE (keys made for the run in
<run_dir>/keys, handed to each agent over its stdin, removed at the end of the run whatever
ends it).

Console lines fit 80 columns (launch/console.py `fit`), except a path or a command, which is
never broken. Logs are then
logs/<host>/<actor>.log (and logs/<host>/agent.log); endpoints.json and exit.json list every host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from launch import files, plot, sinks
from launch.config import (
    ClusterConfig,
    ConfigError,
    load,
    parse_overrides,
    start_order,
)
from launch.console import Story, fit, wrap
from launch.dryrun import print_plan
from launch.endings import Failures
from launch.files import write_json
from launch.resume import already_complete, check_same_run, describe, resume_overrides
from launch.supervisor import RunFailed, Supervisor
from runtime import passthrough
from runtime.loading import plan_side
from transport.metrics import MetricsSubscriber
from transport.sockets import make_curve_keys

console = Console(highlight=False, markup=False, soft_wrap=True)


def say(text: str) -> None:
    console.print(f"{time.strftime('%H:%M:%S')} {text}")


def make_run_dir(cfg: ClusterConfig, explicit: str | None) -> Path:
    if explicit:
        path = Path(explicit)
        path.mkdir(parents=True, exist_ok=True)
        return path.resolve()
    base = Path(cfg.run.dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    path.mkdir(parents=True)
    return path.resolve()


def socket_dir(run_dir: Path) -> tuple[Path, bool]:
    """ipc:// paths must fit in 107 bytes; fall back to a short temporary folder."""
    path = run_dir / "sock"
    if len(str(path)) <= 70:
        path.mkdir(exist_ok=True)
        return path, False
    return Path(tempfile.mkdtemp(prefix="rlx-")), True


def prepare_keys(cfg: ClusterConfig, run_dir: Path) -> Path | None:
    """CURVE on without a keys_dir: a server and a client keypair made for this run in
    <run_dir>/keys (0700, secret files 0600); returns that folder (removed at the end)."""
    sec = cfg.security
    if not sec.curve or sec.keys_dir:
        return None
    folder = run_dir / "keys"
    shutil.rmtree(folder, ignore_errors=True)  # a resumed run gets new keys
    make_curve_keys(folder)
    cfg.security = msgspec.structs.replace(sec, keys_dir=str(folder))
    return folder


def write_endpoints(run_dir: Path, doc: dict) -> None:
    """endpoints.json, whole or not at all; a failure (a full disk) is said and the run goes on
    (only `launch.watch` reads it)."""
    try:
        write_json(run_dir / "endpoints.json", doc)
    except OSError as e:
        say(fit([*f"cannot write {run_dir / 'endpoints.json'} ({e}); the run goes on,".split(" "),
                 f"python -m launch.watch {run_dir}",  # a command stays whole
                 *"cannot find it: give it the metrics address instead".split(" ")]))


def write_exit(room: files.Reserved, done: dict) -> None:
    """exit.json, whole or not at all, in the room taken for it when the run started
    (launch/files.py); a failure to write it is said on stderr, and the launcher still exits
    with the run's code."""
    try:
        room.write(json.dumps(done, indent=2))
    except OSError as e:
        print(f"error: cannot write {room.path} ({e}); the run's exit code is "
              f"{done['exit_code']} ({done['reason']})", file=sys.stderr)


async def show_progress(endpoint: str, sup: Supervisor, record: sinks.Sinks, story: Story,
                        failures: Failures) -> None:
    """Hand every metrics record to the run's sinks (metrics.jsonl, samples/*.jsonl,
    TensorBoard, W&B: launch/sinks.py), tell the story on the console (launch/console.py) and
    count what failed (launch/endings.py). A message that does not decode as a record (or is
    over the limits) is dropped and said once; a record the console cannot tell is said and
    the stream goes on."""
    sub = MetricsSubscriber(sup.factory, endpoint)
    refused_said = broken_said = False
    try:
        async for m in sub:
            record.write(m)
            try:
                story.on_record(m)
                failures.on_record(m)
            except Exception as e:
                if not broken_said:
                    broken_said = True
                    say(wrap(f"console: a record of {m.actor!r} could not be told "
                             f"({type(e).__name__}: {e}); it is in the sinks, later ones "
                             f"that fail are not said"))
            if sub.refused and not refused_said:
                refused_said = True
                say(wrap(f"metrics: {sub.refused} message(s) on the metrics stream were not "
                         f"records (malformed, or over [limits]) and were dropped; later ones "
                         f"are counted, not said"))
    finally:
        sub.close()


def completion_line(run_dir: Path, completed: str, started: float) -> str:
    """What a finished run says last: who completed, the time, the final evaluation, where the
    results are (lines of 80 columns)."""
    parts = [f"run complete: {completed} finished in",
             f"{format_duration(time.monotonic() - started)};"]
    try:
        final = json.loads((run_dir / "final_eval.json").read_text())
        scores = [f"{d} {v:.3g}" for d, v in sorted(final["scores"].items())]
        parts += ["final", "eval", "at", "step", f"{final['step']}:",
                  *[f"{s}," for s in scores[:-1]], f"{scores[-1]};"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        pass  # not an RL run, or no final evaluation
    return fit([*parts, "results in", str(run_dir)])


def format_duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def write_plots(cfg: ClusterConfig, run_dir: Path) -> None:
    """The end-of-run plots (launch/plot.py); any failure is said, never raised."""
    if "jsonl" not in cfg.run.sinks:
        say(wrap("plots: none, they are drawn from metrics.jsonl and the jsonl sink is off"))
        return
    try:
        result = plot.plot_run(run_dir)
    except (Exception, KeyboardInterrupt) as e:
        say(fit([*f"plots failed ({type(e).__name__}: {e}); the run's result is unchanged;"
                 .split(" "), f"retry with python -m launch.plot {run_dir}"]))
        return
    if not result.written:  # not an RL run (the demo cluster, tests): one line is enough
        say(wrap("plots: none, no series they draw is in metrics.jsonl (python -m launch.plot "
                 "--help lists them)"))
        return
    for note in result.notes:
        say(wrap(f"plots: {note}"))
    say(fit(["plots:", *[f"{n}," for n in sorted(result.written)][:-1],
             sorted(result.written)[-1], "in", str(run_dir / "plots")]))


async def run_cluster(cfg: ClusterConfig, order: list[str], run_dir: Path,
                      resume: bool = False, resolved: dict | None = None,
                      keys: Path | None = None) -> int:
    """Run the cluster to its end and return the exit code (module docstring); the run's own
    CURVE keys (`keys`, prepare_keys) are removed however it ends."""
    try:
        return await _run_cluster(cfg, order, run_dir, resume, resolved)
    finally:
        if keys is not None:
            shutil.rmtree(keys, ignore_errors=True)


async def _run_cluster(cfg: ClusterConfig, order: list[str], run_dir: Path, resume: bool,
                       resolved: dict | None) -> int:
    try:
        record = sinks.open_sinks(cfg.run, run_dir, resolved or msgspec.to_builtins(cfg), say)
    except sinks.SinkError as e:
        console.print(f"error: {e}; nothing was started", style="bold red")
        return 2
    exit_room = files.Reserved(run_dir / "exit.json")  # a disk full at the end still gets it
    sock_dir, temporary = socket_dir(run_dir)
    sup = Supervisor(cfg, run_dir, sock_dir, order, say, resume)
    try:
        endpoints = sup.open()
    except BaseException as e:  # its sockets do not bind (AddressError): said by main()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        write_exit(exit_room, {"exit_code": 1, "reason": f"failed: {first}", "completed": None,
                               "actors": {}})
        sup.close()
        if temporary:
            shutil.rmtree(sock_dir, ignore_errors=True)
        record.close(1)
        raise
    write_endpoints(run_dir, endpoints)
    interrupted = asyncio.Event()
    received: list[signal.Signals] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        interrupted.set()
        sup.events.put_nowait(("interrupt", ""))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    story = Story(say, cfg.run.progress_interval_s, cfg.run.show_samples_every)
    failures = Failures()
    progress = asyncio.ensure_future(show_progress(endpoints["metrics"], sup, record, story,
                                                   failures))
    say(fit(["run directory", str(run_dir)]))
    say(fit(["metrics at", endpoints["metrics"]]))
    code, started, reason = 1, time.monotonic(), "the launcher failed (its traceback says why)"
    try:
        starter = asyncio.ensure_future(sup.start_all())
        stop_wait = asyncio.ensure_future(interrupted.wait())
        await asyncio.wait({starter, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        code = 0
        if not interrupted.is_set():
            starter.result()
            write_endpoints(run_dir, sup.endpoints_document())  # with the actors'
            code = await sup.supervise()
        else:
            starter.cancel()
            say("interrupted during start: stopping every actor")
        if sup.completed is None and received:  # the run stopped unfinished: not a success
            code, reason = 128 + received[0], f"interrupted by {received[0].name}"
        else:
            reason = f"{sup.completed} completed" if sup.completed else "stopped"
    except RunFailed as e:
        console.print(f"RUN FAILED: {e}", style="bold red")
        code, reason = 1, f"failed: {str(e).splitlines()[0]}"
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await sup.stop_all()
        progress.cancel()
        await asyncio.gather(progress, return_exceptions=True)
        summary = sup.summary()
        totals = failures.totals()
        env_failed = totals["env_failed"]
        completed = sup.completed if code == 0 else None
        if code == 0 and env_failed and not cfg.run.tolerate_failures:
            code, reason = 1, (f"{sup.completed or 'the run'} completed, but {env_failed} "
                               f"episode(s) failed in their environment "
                               f"([run] tolerate_failures = false)")
        done = {"exit_code": code, "reason": reason, "completed": completed,
                "actors": summary}
        if totals["episodes_failed"]:
            done["failures"] = {**totals, "tolerated": cfg.run.tolerate_failures}
        if sup.distributed:
            done["hosts"] = sup.hosts_summary()
        write_exit(exit_room, done)
        sup.close()
        if temporary:
            shutil.rmtree(sock_dir, ignore_errors=True)
        record.close(code)  # after exit.json: an online W&B run may take a while to finish
    steps = [f"{n}: {s['shutdown_step']}," for n, s in summary.items()]
    if steps:
        steps[0], steps[-1] = f"({steps[0]}", f"{steps[-1][:-1]});"
    say(fit(["stopped", *steps, "exit", "code", str(code)]))
    if cfg.run.plots:
        write_plots(cfg, run_dir)
    lines = failures.summary()
    if lines:
        say(wrap(lines))
    if completed and env_failed and code == 1:
        say(wrap(f"run ended with exit code 1: {completed} completed every step, but "
                 f"{env_failed} episode(s) failed in their environment (samples/*.jsonl has "
                 f"them); set [run] tolerate_failures = true to accept such a run"))
    elif code == 0 and sup.completed:
        say(completion_line(run_dir, sup.completed, started))
    elif received and code > 128:
        source = (resolved or {}).get("source", "<hosts.toml>")
        say(f"run {reason}, unfinished (exit code {code}); continue it with: python -m "
            f"launch.cluster {source} --resume {run_dir}")
    return code


def main(argv: list[str] | None = None) -> int:
    """The launcher: it checks and supervises actors and runs none, so it reads each actor class
    from its plan class, when it has one (runtime/loading.py): a heavy actor module (torch) is
    imported by the actor's own process only."""
    with plan_side():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.cluster", description=__doc__,
                                     epilog=passthrough.HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hosts", help="path of the cluster's hosts.toml")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and check each host's engines and address; start "
                             "nothing; exit 1 when something is missing")
    parser.add_argument("--run-dir", help="use this run directory instead of <dir>/<name>-<time>")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its latest checkpoint, with the "
                             "--set overrides recorded there; the config must be the run's, "
                             "except num_steps (--set rl.num_steps=N), the layout (parallel, "
                             "devices, hosts, weight sync, micro-batches, staleness) and [run]'s "
                             "supervision fields (launch/resume.py)")
    parser.add_argument("--allow-changes", action="store_true",
                        help="with --resume: continue the run even though its config changed "
                             "beyond those (each change is said and recorded)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="PATH=VALUE",
                        help="override one hosts.toml value before the checks (repeatable): "
                             "--set actors.trainer.config.optimizer.lr=3e-5 --set run.name=x")
    tables, rest = passthrough.parse(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    if args.resume:
        if not (Path(args.resume) / "config.json").is_file():
            print(f"error: --resume {args.resume}: not a run directory (no config.json)",
                  file=sys.stderr)
            return 2
        args.run_dir = args.resume
    try:
        if args.resume:
            given = args.overrides
            args.overrides = resume_overrides(Path(args.resume), given)
            if args.overrides != given:
                say(wrap(f"resume: applying the run's recorded "
                         f"{' '.join(f'--set {o}' for o in args.overrides if o not in given)}"))
        notes: list[str] = []
        cfg = load(args.hosts, tables, parse_overrides(args.overrides), notes)
        order = start_order(cfg, args.hosts)
        sinks.check(cfg.run, args.hosts)
        changes = check_same_run(Path(args.resume), msgspec.to_builtins(cfg),
                                 args.allow_changes) if args.resume else []
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if changes:
        say(wrap(f"resume: continuing with changes (recorded -> given): {describe(changes)}"))
    done = already_complete(Path(args.resume), cfg) if args.resume else None
    if done:
        print(f"run {args.resume} is already complete ({done}); nothing to resume. Raise "
              f"num_steps to train further (--set rl.num_steps=N, or in the file), or start a "
              f"new run (without --resume).")
        return 0
    for note in notes:
        say(wrap(f"note: {note}"))
    if cfg.run.python_path:  # every actor process (launch/supervisor.py) inherits PYTHONPATH
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [*cfg.run.python_path, *filter(None, [os.environ.get("PYTHONPATH")])])
    if args.dry_run:
        return print_plan(cfg, order, args.hosts)
    keys: Path | None = None
    try:
        run_dir = make_run_dir(cfg, args.run_dir)
        keys = prepare_keys(cfg, run_dir)  # before the config is recorded: its keys_dir
        resolved = {"source": str(Path(args.hosts).resolve()), "start_order": order,
                    "overrides": list(args.overrides), **msgspec.to_builtins(cfg)}
        write_json(run_dir / "config.json", resolved)
    except OSError as e:
        if keys is not None:  # the run's own keys never outlive it
            shutil.rmtree(keys, ignore_errors=True)
        print(f"error: cannot prepare the run directory: {e}; nothing was started",
              file=sys.stderr)
        return 1
    try:
        return run(run_cluster(cfg, order, run_dir, bool(args.resume), resolved, keys))
    except OSError as e:  # the run's own files are handled where written: this is the rest
        print(f"error: {type(e).__name__}: {e}; the run stopped (exit code 1)", file=sys.stderr)
        return 1


def run(main_task: Any) -> int:
    """`main_task` on uvloop when installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_task)
    return uvloop.run(main_task)


if __name__ == "__main__":
    sys.exit(main())
