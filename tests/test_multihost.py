"""Runs over several hosts: the agent (launch/agent.py), the supervisor's remote path, CURVE by
default, the remote version check, `hosts = "slurm"`.

The hosts are Linux network namespaces with their own addresses (a veth pair from the root
namespace, where the launcher runs, to each), made and removed by the `netns` fixture; `exec` is
`ip netns exec NAME`. They share this filesystem, so `workdir` is this checkout. Without root or
without `ip netns`, those tests are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import zmq.auth

from launch.agent import (
    PROJECT_PACKAGES,
    agent_command,
    agent_folder,
    compare,
    environment_report,
    remove_abandoned,
)
from launch.cluster import main
from launch.config import ConfigError, load
from tests.helpers import MessageReader
from tests.test_cluster import launch as run_launcher
from transport.addresses import local_addresses
from transport.sockets import make_curve_keys

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- namespaces
@dataclass
class Netns:
    name: str  # the namespace: the remote host
    root_address: str  # the launcher's end of the veth pair
    address: str  # the namespace's end

    @property
    def exec(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns():
    """A namespace host reached over a veth pair; removed at the end, even on failure."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network-namespace hosts need Linux, root and iproute2's `ip`")
    n = os.getpid() % 32768  # distinct per test process: names and a /30 of its own
    ns, root_if, ns_if = f"rlx{n}b", f"rlx{n}r", f"rlx{n}n"
    net = f"10.{128 + (n >> 8)}.{n & 255}"
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here (`ip netns add` said: "
                    f"{made.stderr.strip()})")
    try:
        for args in (("link", "add", root_if, "type", "veth", "peer", "name", ns_if),
                     ("link", "set", ns_if, "netns", ns),
                     ("addr", "add", f"{net}.1/30", "dev", root_if),
                     ("link", "set", root_if, "up"),
                     ("-n", ns, "addr", "add", f"{net}.2/30", "dev", ns_if),
                     ("-n", ns, "link", "set", ns_if, "up"),
                     ("-n", ns, "link", "set", "lo", "up")):
            done = _ip(*args)
            if done.returncode != 0:
                pytest.skip(f"cannot wire the namespace (`ip {' '.join(args)}`: "
                            f"{done.stderr.strip()})")
        yield Netns(ns, f"{net}.1", f"{net}.2")
    finally:
        _ip("link", "del", root_if)
        _ip("netns", "del", ns)


def hosts_toml(ns: Netns, run: str = "", remote: str = "") -> str:
    return textwrap.dedent(f"""
        [run]
        name = "mh"
        heartbeat_interval_s = 0.3
        progress_interval_s = 1.0
        plots = false
        {run}

        [[hosts]]
        name = "main"
        address = "{ns.root_address}"

        [[hosts]]
        name = "nsb"
        address = "{ns.address}"
        exec = {json.dumps(ns.exec)}
        {remote}
        """)


def tiny_rl(groups_per_batch: int, num_steps: int, micro_batch_size: int) -> str:
    """An `[rl]` table of the main job, small: one worker, groups of 4, no evaluation."""
    return textwrap.dedent(f"""
        [rl]
        model = "{ROOT / 'examples' / 'base-tiny'}"
        workers = 1
        group_size = 4
        groups_per_batch = {groups_per_batch}
        num_steps = {num_steps}
        micro_batch_size = {micro_batch_size}
        eval_every = 0
        eval_tasks = 4
        envs = [{{ cls = "envs.builtin.arith:ArithEnv", options = {{ max_operand = 9 }} }}]
        """)


def wait_for_line(proc: subprocess.Popen, pattern: str, lines: list[str],
                  timeout_s: float = 60) -> re.Match:
    """Read the launcher's output until a line matches `pattern` (kept in `lines`)."""
    deadline = time.monotonic() + timeout_s
    reader = MessageReader()  # a message wrapped at 80 columns is matched whole
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(pattern, reader.add(line)):
            return m
    raise AssertionError(f"never saw {pattern!r}; output:\n{''.join(lines)}")


# ----------------------------------------------------------------------------- the main job
def test_main_job_split_over_two_hosts_runs_to_completion_with_metrics(netns, tmp_path):
    """The worker and router on the namespace host, buffer/rollout/trainer with the launcher:
    HTTP, ZMQ (CURVE) and disk weight sync cross hosts; three GRPO steps complete."""
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(hosts_toml(netns) + tiny_rl(groups_per_batch=4, num_steps=3,
                                                 micro_batch_size=16) + textwrap.dedent("""
        [actors.worker0]
        host = "nsb"
        [actors.router]
        host = "#1"
        """))
    run_dir = tmp_path / "run"
    result = run_launcher(hosts, run_dir, timeout_s=110)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "run complete: trainer finished" in out
    assert re.search(r"host nsb: agent pid \d+ ready", out)
    done = json.loads((run_dir / "exit.json").read_text())
    assert done["completed"] == "trainer"
    assert {n: a["host"] for n, a in done["actors"].items()} == {
        "worker0": "nsb", "router": "nsb", "buffer": "main",
        "rollout": "main", "trainer": "main"}
    assert done["hosts"]["nsb"]["agent"]["exit_code"] == 0
    assert done["hosts"]["nsb"]["agent"]["lost"] is None
    for name in ("worker0", "router"):
        assert done["actors"][name]["shutdown_step"] == "message"
    # every socket on tcp:// at its host's address, CURVE on with keys made for the run
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    assert endpoints["metrics"].startswith(f"tcp://{netns.root_address}:")
    assert endpoints["actors"]["worker0"]["rpc" if "rpc" in endpoints["actors"]["worker0"]
                                          else "control"].startswith(f"tcp://{netns.address}:")
    assert endpoints["actors"]["worker0"]["http"].startswith(f"http://{netns.address}:")
    assert endpoints["actors"]["trainer"]["control"].startswith(f"tcp://{netns.root_address}:")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["security"]["curve"] is True
    assert config["security"]["keys_dir"] == str(run_dir / "keys")
    assert not (run_dir / "keys").exists()  # removed with the run
    # metrics from both hosts reached the launcher (metrics.jsonl is what it received)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    actors = {r["actor"] for r in records}
    assert {"worker0", "trainer", "rollout", "buffer"} <= actors, actors
    steps = [r["step"] for r in records if r["actor"] == "trainer" and "version" in r["values"]]
    assert max(steps) == 3
    # logs of every host's actors in the run directory
    for host, names in (("nsb", ("worker0", "router")),
                        ("main", ("buffer", "rollout", "trainer"))):
        for name in names:
            log = (run_dir / "logs" / host / f"{name}.log").read_text()
            assert f"{name} INFO {name}: stopp" in log, log[-2000:]
    assert "serving run" in (run_dir / "logs" / "nsb" / "agent.log").read_text()


def test_trainer_ranks_on_two_hosts_from_parallel_hosts(netns, tmp_path):
    """`parallel.hosts` places the trainer's rank 1 on the namespace host: the launcher starts it
    there through that host's agent, as any process of the run (its log in
    logs/nsb/trainer.rank1.log), it reaches rank 0's store at the launcher host's address,
    gloo runs over each host's own interface, and two data-parallel GRPO steps complete."""
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(hosts_toml(netns) + tiny_rl(groups_per_batch=2, num_steps=2,
                                                 micro_batch_size=4) + textwrap.dedent("""
        [actors.trainer.config]
        parallel = { dp = 2, hosts = ["main", "nsb"], timeout_s = 60 }
        """))
    run_dir = tmp_path / "run"
    result = run_launcher(hosts, run_dir, timeout_s=110)
    out = result.stdout + result.stderr
    rank1_log = run_dir / "logs" / "nsb" / "trainer.rank1.log"
    assert result.returncode == 0, out + (rank1_log.read_text() if rank1_log.is_file()
                                          else f"\n(no {rank1_log})")
    # the host runs no actor but the trainer's rank 1, through its agent
    assert re.search(r"host nsb: agent pid \d+ ready", out), out
    assert re.search(r"trainer\.rank1 READY \(pid \d+\)", out), out
    config = json.loads((run_dir / "config.json").read_text())
    placement = config["actors"]["trainer"]["config"]["parallel"]["placement"]
    assert placement == [{"name": "main", "address": netns.root_address},
                         {"name": "nsb", "address": netns.address}]
    rank1 = rank1_log.read_text()
    # the interface holding the namespace's address exists only inside the namespace
    assert f"trainer rank 1 of 2 on {netns.address} (store {netns.root_address}:" in rank1
    assert "over interface rlx" in rank1, rank1[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["values"] for r in records if r["actor"] == "trainer" and "version" in r["values"]]
    assert [v["version"] for v in steps] == [1, 2]
    assert all(v["train/dp_size"] == 2 and v["train/samples"] == 8 for v in steps)


def test_rank_hosts_are_checked_at_load(netns, tmp_path):
    hosts = tmp_path / "hosts.toml"
    base = hosts_toml(netns) + textwrap.dedent(f"""
        [rl]
        model = "{ROOT / 'examples' / 'base-tiny'}"
        workers = 1
        envs = [{{ cls = "envs.builtin.arith:ArithEnv" }}]
        [actors.trainer.config]
        """)
    for parallel, words in (('{ dp = 2, hosts = ["nsb", "main"] }', "start the list with 'main'"),
                            ('{ dp = 2, hosts = ["main", "gpu9"] }', "unknown host(s) ['gpu9']"),
                            ('{ dp = 3, hosts = ["main", "nsb"] }', "ranks_per_host")):
        hosts.write_text(base + f"parallel = {parallel}\n")
        with pytest.raises(ConfigError, match=re.escape(words)):
            load(hosts)


# ----------------------------------------------------------------------------- losing a host
CLIENT = """
import asyncio, json, sys
from transport.metrics import MetricsPublisher
from transport.rpc import DeadlineExceeded, RpcClient
from examples.demo import Scale
from transport.sockets import Security, SocketFactory
import torch

async def answer(factory, endpoint, msg=None):
    client = RpcClient(factory, endpoint, "intruder", timeout_s=2.0)
    try:
        reply = await client.handshake()
        if msg is not None:
            reply = await client.call(msg)
        return type(reply).__name__ + (f" {float(reply.tensor.sum())}" if msg else "")
    except DeadlineExceeded:
        return None
    finally:
        await client.close()

async def main(endpoints, keys):
    plain = SocketFactory()
    keyed = SocketFactory(security=Security(curve=True, keys_dir=keys))
    rpc = endpoints["actors"]["scaler"]["rpc"]
    intruder = MetricsPublisher(plain, endpoints["metrics_in"], "intruder")
    for _ in range(20):
        intruder.publish({"fake": 1.0}, step=1)
    out = {"plain_rpc": await answer(plain, rpc, Scale(tensor=torch.ones(4), factor=2.0)),
           "plain_supervisor": await answer(plain, endpoints["supervisor"]),
           "keyed_rpc": await answer(keyed, rpc, Scale(tensor=torch.ones(4), factor=2.0))}
    intruder.close()
    plain.close()
    keyed.close()
    print(json.dumps(out))

asyncio.run(main(json.loads(sys.argv[1]), sys.argv[2]))
"""


def test_unauthenticated_client_gets_nothing_and_a_killed_agent_is_reported_by_host(
        netns, tmp_path):
    """A client in the namespace host without the run's keys gets no answer from an actor or
    the supervisor and cannot inject metrics (with the keys: answered). Then the agent is
    killed: the launcher names the host, the actor restarts through a new agent, and the old
    actor process is gone."""
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(hosts_toml(netns, run="shutdown_timeout_s = 10.0") + textwrap.dedent("""
        [actors.idle]
        cls = "tests.misbehaving:Idle"
        [actors.scaler]
        cls = "examples.demo:Scaler"
        host = "nsb"
        after = ["idle"]
        restart = { max_restarts = 1 }
        """))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        agent_pid = int(wait_for_line(proc, r"host nsb: agent pid (\d+) ready", lines)[1])
        first_pid = int(wait_for_line(proc, r"scaler READY \(pid (\d+)\)", lines)[1])
        deadline = time.monotonic() + 30
        while "actors" not in (doc := json.loads((run_dir / "endpoints.json").read_text())):
            assert time.monotonic() < deadline, "endpoints.json never listed the actors"
            time.sleep(0.1)
        assert doc["actors"]["scaler"]["rpc"].startswith(f"tcp://{netns.address}:")
        client = subprocess.run([*netns.exec, sys.executable, "-c", CLIENT, json.dumps(doc),
                                 str(run_dir / "keys")], cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        seen = json.loads(client.stdout)
        assert seen == {"plain_rpc": None, "plain_supervisor": None,
                        "keyed_rpc": "ScaleReply 8.0"}
        os.kill(agent_pid, signal.SIGKILL)
        wait_for_line(proc, r"host nsb lost: its agent exited with code -9; its actors "
                            r"\(scaler\)", lines)
        wait_for_line(proc, r"scaler failed \(exit code 255\); restart 1/1", lines)
        new_agent = int(wait_for_line(proc, r"host nsb: agent pid (\d+) ready", lines)[1])
        second_pid = int(wait_for_line(proc, r"scaler READY \(pid (\d+)\)", lines)[1])
        assert new_agent != agent_pid and second_pid != first_pid
        assert not psutil.pid_exists(first_pid) or \
            psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        lines.append(out)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    text = "".join(lines)
    assert proc.returncode == 130, text  # interrupted (SIGINT)
    done = json.loads((run_dir / "exit.json").read_text())
    assert done["hosts"]["nsb"]["lost"] == ["its agent exited with code -9"]
    assert done["hosts"]["nsb"]["agent"]["agent_pid"] == new_agent
    assert done["actors"]["scaler"]["restarts"] == 1
    assert done["actors"]["scaler"]["shutdown_step"] == "message"
    assert done["actors"]["scaler"]["pid"] == second_pid
    records = (run_dir / "metrics.jsonl").read_text()
    assert '"intruder"' not in records
    log = (run_dir / "logs" / "nsb" / "scaler.log").read_text()
    assert log.count("=== start") == 2


def test_a_host_lost_past_the_restart_budget_ends_the_run_naming_it(netns, tmp_path):
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(hosts_toml(netns) + textwrap.dedent("""
        [actors.idle]
        cls = "tests.misbehaving:Idle"
        host = "nsb"
        restart = { max_restarts = 0 }
        """))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        agent_pid = int(wait_for_line(proc, r"host nsb: agent pid (\d+) ready", lines)[1])
        wait_for_line(proc, r"idle READY", lines)
        os.kill(agent_pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    text = "".join(lines) + out
    assert proc.returncode == 1, text
    assert "RUN FAILED: idle failed (exit code 255) after 0 restart(s)" in text
    assert "host nsb lost: its agent exited with code -9" in text
    done = json.loads((run_dir / "exit.json").read_text())
    assert done["actors"]["idle"]["error"] == "host nsb lost: its agent exited with code -9"
    # the killed agent could not remove its folder (the run's keys): the next agent does
    folder = agent_folder(str(run_dir.resolve()), "nsb")
    assert (folder / "keys" / "client.key_secret").stat().st_mode & 0o777 == 0o600
    assert folder.stat().st_mode & 0o777 == 0o700
    assert folder in remove_abandoned(folder.parent) and not folder.exists()


# ----------------------------------------------------------------------------- bad addresses
UNASSIGNED = ("198.51.100.77", "198.51.100.78")  # TEST-NET-2: no machine's own address


def this_machines_address() -> str:
    """A non-loopback IPv4 address of this machine (the test is skipped without one)."""
    found = [a for a in local_addresses() if "." in a and not a.startswith("127.")]
    if not found or set(UNASSIGNED) & set(local_addresses()):
        pytest.skip("needs a non-loopback IPv4 address, and none of TEST-NET-2's")
    return found[0]


def far_host(main_address: str, far_address: str, exec_: list[str]) -> str:
    return textwrap.dedent(f"""
        [run]
        name = "bad-address"
        heartbeat_interval_s = 0.3
        plots = false
        [[hosts]]
        name = "main"
        address = "{main_address}"
        [[hosts]]
        name = "far"
        address = "{far_address}"
        exec = {json.dumps(exec_)}
        [actors.idle]
        cls = "tests.misbehaving:Idle"
        host = "far"
        """)


def one_line_failure(result: subprocess.CompletedProcess, host: str) -> str:
    """The launcher's one line about `host` (and nothing like a traceback anywhere)."""
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "Traceback" not in out and "ZMQError" not in out, out
    said = [line for line in out.splitlines() if f"host {host}:" in line]
    assert len(said) == 1, out
    return said[0]


def test_an_address_that_is_not_the_hosts_is_one_line_and_nothing_stays(tmp_path):
    """The launcher's host entry with an address of no interface here, then a remote host's
    (its agent through a plain local `exec` prefix): one line each, exit code 1, no actor
    started, the agent gone with its private folder, the run's keys removed."""
    here = this_machines_address()
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(far_host(UNASSIGNED[0], UNASSIGNED[1], ["env"]))
    line = one_line_failure(run_launcher(hosts, tmp_path / "run1"), "main")
    assert not (tmp_path / "run1" / "keys").exists()
    assert line.startswith(f"error: AddressError: host main: the launcher's sockets cannot "
                           f"bind {UNASSIGNED[0]} (port 0: any free port): {UNASSIGNED[0]} is "
                           f"not an address of this machine (its addresses: {here}"), line
    assert "set `address` of [[hosts]] 'main' (the launcher's host) to one of them" in line
    # exit.json says it, and nothing half-written stays (its room is given back)
    assert json.loads((tmp_path / "run1" / "exit.json").read_text())["reason"].startswith(
        "failed: host main: the launcher's sockets cannot bind")
    assert not list((tmp_path / "run1").glob("*.tmp"))
    hosts.write_text(far_host(here, UNASSIGNED[1], ["env"]))
    run_dir = tmp_path / "run2"
    result = run_launcher(hosts, run_dir)
    line = one_line_failure(result, "far")
    assert line.startswith(f"RUN FAILED: host far: cannot bind its address {UNASSIGNED[1]} "
                           f"(port 0) there: {UNASSIGNED[1]} is not an address of that host "
                           f"(its addresses: {here}"), line
    assert line.endswith("set `address` of [[hosts]] 'far' to an address of it"), line
    assert "READY" not in result.stdout
    done = json.loads((run_dir / "exit.json").read_text())
    assert done["exit_code"] == 1 and done["actors"] == {}
    agent_pid = done["hosts"]["far"]["agent"]["agent_pid"]
    assert agent_pid and not psutil.pid_exists(agent_pid)
    assert not agent_folder(str(run_dir.resolve()), "far").exists()  # its copy of the keys
    assert not (run_dir / "keys").exists()
    # the host's address is right, but an actor's fixed port there is taken
    with socket.socket() as taken:
        taken.bind((here, 0))
        taken.listen()
        port = taken.getsockname()[1]
        hosts.write_text(far_host(here, here, ["env"]).replace(
            'cls = "tests.misbehaving:Idle"',
            f'cls = "actors.inference:InferenceWorker"\nconfig = {{ model = "tiny", '
            f'port = {port} }}'))
        line = one_line_failure(run_launcher(hosts, tmp_path / "run3"), "far")
    assert line == (f"RUN FAILED: host far: [actors.idle.config] port = {port} cannot be bound "
                    f"on {here} there: port {port} is in use on {here}: pick another port, or "
                    f"0 (any free port)"), line


def test_hosts_that_do_not_reach_each_other_are_one_line_each(netns, tmp_path):
    """The namespace host at an address of its own that the launcher's namespace has no route
    to, then the launcher's host at an address of this machine the namespace has no route to:
    each said in one line naming the host, the address and the port, exit code 1."""
    hidden = netns.address.rsplit(".", 1)[0] + ".6"  # outside the veth pair's /30
    assert _ip("-n", netns.name, "addr", "add", f"{hidden}/32", "dev", "lo").returncode == 0
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(far_host(netns.root_address, hidden, netns.exec))
    line = one_line_failure(run_launcher(hosts, tmp_path / "run1"), "far")
    assert re.fullmatch(rf"RUN FAILED: host far: the launcher cannot reach "
                        rf"{re.escape(hidden)}:\d+ there: .+; set `address` of \[\[hosts\]\] "
                        rf"'far' to an address the launcher's host reaches, or let it reach "
                        rf"that port", line), line
    elsewhere = next((a for a in local_addresses() if "." in a and not a.startswith("127.")
                      and a != netns.root_address), None)
    if elsewhere is None:
        pytest.skip("this machine has no second non-loopback IPv4 address")
    hosts.write_text(far_host(elsewhere, netns.address, netns.exec))
    line = one_line_failure(run_launcher(hosts, tmp_path / "run2"), "far")
    assert re.fullmatch(rf"RUN FAILED: host far: cannot reach the launcher at "
                        rf"{re.escape(elsewhere)}:\d+ from there: .+; set `address` of "
                        rf"\[\[hosts\]\] 'main' \(the launcher's host\) to an address far "
                        rf"reaches, or let it reach that port", line), line


def test_run_keys_are_private_from_their_creation_whatever_was_there(tmp_path):
    """make_curve_keys under a umask that lets everyone read, into a folder that already holds
    a world-readable secret key file and is itself open: the folder ends 0700 and every secret
    file 0600 with a new key (the old file was replaced, not rewritten in place); the run
    directory above keeps its own mode."""
    folder = tmp_path / "run" / "keys"
    folder.mkdir(parents=True, mode=0o777)
    folder.chmod(0o777)
    old = folder / "server.key_secret"
    old.write_text("old secret")
    old.chmod(0o644)
    held = open(old)  # keeps the old file's inode: it must not be the one written
    mask = os.umask(0)
    try:
        make_curve_keys(folder)
        make_curve_keys(tmp_path / "fresh" / "keys")
    finally:
        os.umask(mask)
    for keys in (folder, tmp_path / "fresh" / "keys"):
        assert keys.stat().st_mode & 0o777 == 0o700
        modes = {f.name: f.stat().st_mode & 0o777 for f in keys.iterdir()}
        assert modes == {"server.key_secret": 0o600, "client.key_secret": 0o600,
                         "server.key": 0o644, "client.key": 0o644}
        public, secret = zmq.auth.load_certificate(str(keys / "server.key_secret"))
        assert len(public) == len(secret) == 40
        assert zmq.auth.load_certificate(str(keys / "server.key"))[0] == public
    assert held.read() == "old secret"
    assert (folder / "server.key_secret").stat().st_ino != os.fstat(held.fileno()).st_ino
    held.close()
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o777  # made under umask 0


# ----------------------------------------------------------------------------- version check
def test_a_host_whose_code_differs_is_refused_before_anything_starts(netns, tmp_path):
    """The remote workdir is a copy of the project with one file changed: the launcher names
    the file and starts no actor."""
    copy = tmp_path / "elsewhere"
    for pkg in PROJECT_PACKAGES:
        if (ROOT / pkg / "__init__.py").is_file():
            shutil.copytree(ROOT / pkg, copy / pkg,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pt", "*.safetensors",
                                                          "*.bin", "*.png"))
    with open(copy / "transport" / "codec.py", "a") as f:
        f.write("\n# changed on that host only\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(hosts_toml(netns, remote=f'workdir = "{copy}"') + textwrap.dedent("""
        [actors.idle]
        cls = "tests.misbehaving:Idle"
        [actors.far]
        cls = "tests.misbehaving:Idle"
        host = "nsb"
        """))
    run_dir = tmp_path / "run"
    result = run_launcher(hosts, run_dir, timeout_s=60)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "host nsb: its code or environment differs from the launcher's" in out
    # (a file edited in this checkout while the test copies it may be listed too)
    assert re.search(r"files that differ: [^\n]*transport/codec\.py", out), out
    assert "READY" not in out
    assert not (run_dir / "logs" / "nsb" / "far.log").exists()
    assert json.loads((run_dir / "exit.json").read_text())["actors"] == {}


def test_compare_says_what_differs():
    here = environment_report()
    assert compare(here, json.loads(json.dumps(here))) == ([], [])
    there = json.loads(json.dumps(here))
    there["python"] = "3.10.4"
    there["version"] = "0.0.9"
    there["packages"]["pyzmq"] = "24.0.0"
    there["packages"]["torch"] = "2.13.0+cu128"
    there["packages"].pop("numpy")
    there["files"]["launch/agent.py"] = "0" * 16
    there["files"].pop("transport/rpc.py")
    there["files"]["extra/mod.py"] = "1" * 16
    errors, notes = compare(here, there)
    text = "\n".join(errors)
    assert f"Python 3.10.4 there, {here['python']} here" in text
    assert f"rlx 0.0.9 there, {here['version']} here" in text
    assert f"pyzmq 24.0.0 there, {here['packages']['pyzmq']} here" in text
    assert f"numpy (not installed) there, {here['packages']['numpy']} here" in text
    assert "files that differ: launch/agent.py" in text
    assert "files missing there: transport/rpc.py" in text
    assert "files only there: extra/mod.py" in text
    assert notes == [f"torch 2.13.0+cu128 there, {here['packages']['torch']} here"]


def test_agent_command_is_quoted_only_for_a_shell():
    words = agent_command(["ip", "netns", "exec", "b"], "/opt/py 3/bin/python", "/srv/my run")
    assert words == ["ip", "netns", "exec", "b", "sh", "-c",
                     'cd "$0" && exec "$1" -m launch.agent', "/srv/my run",
                     "/opt/py 3/bin/python"]
    ssh = agent_command(["ssh", "-o", "BatchMode=yes", "node2"], "python3", "/srv/my run")
    assert ssh[:4] == ["ssh", "-o", "BatchMode=yes", "node2"] and len(ssh) == 5
    assert ssh[4] == "sh -c 'cd \"$0\" && exec \"$1\" -m launch.agent' '/srv/my run' python3"


# ----------------------------------------------------------------------------- hosts.toml
DEMO = """
[actors.scaler]
cls = "examples.demo:Scaler"
host = "{scaler}"
[actors.consumer]
cls = "examples.demo:Consumer"
[actors.producer]
cls = "examples.demo:Producer"
after = ["scaler", "consumer"]
primary = true
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


def test_two_hosts_get_tcp_curve_and_http_addresses_one_host_keeps_ipc(tmp_path):
    two = """
[run]
name = "x"
[[hosts]]
name = "a"
address = "10.1.0.1"
[[hosts]]
name = "b"
address = "10.1.0.2"
exec = ["ssh", "b"]
[actors.w]
cls = "actors.inference:InferenceWorker"
host = "b"
config = { model = "tiny" }
"""
    notes: list[str] = []
    cfg = load(write(tmp_path, two), notes=notes)
    assert cfg.run.transport == "tcp" and cfg.security.curve is True
    assert cfg.actors["w"].config["host"] == "10.1.0.2"  # its HTTP server, reached from others
    assert any("transport tcp" in n for n in notes)
    one = load(write(tmp_path, two.replace('host = "b"\n', "")))
    assert one.run.transport == "ipc" and one.security.curve is False
    assert "host" not in one.actors["w"].config
    off = load(write(tmp_path, two + "[security]\ncurve = false\n"), notes=notes)
    assert off.security.curve is False and any("curve = false" in n for n in notes)


@pytest.mark.parametrize("edit, words", [
    (('address = "10.1.0.2"', 'address = "127.0.0.1"'),
     ["[hosts.#2], field `address`", "loopback", "'b'"]),
    (('address = "10.1.0.1"', 'address = "localhost"'),
     ["[hosts.#1], field `address`", "give host 'a' an address the other hosts reach"]),
    (('host = "#1"', 'host = "#2"'), ["[actors.scaler], field `host`", "#0 to #1"]),
    (('name = "b"', 'name = "b c"'), ["[hosts.#2], field `name`", "host names are letters"]),
    (('exec = ["ssh", "b"]', 'exec = ["ssh", ""]'), ["[hosts.#2], field `exec`", "non-empty"]),
    (("gpus = 8", "gpus = -1"), ["field `gpus`", "use 0"]),
])
def test_host_mistakes_name_the_table_and_field(tmp_path, edit, words):
    text = """
[run]
name = "x"
[[hosts]]
name = "a"
address = "10.1.0.1"
[[hosts]]
name = "b"
address = "10.1.0.2"
exec = ["ssh", "b"]
gpus = 8
""" + DEMO.format(scaler="#1")
    load(write(tmp_path, text))
    with pytest.raises(ConfigError) as e:
        load(write(tmp_path, text.replace(*edit)))
    for word in words:
        assert word in str(e.value), str(e.value)


def test_an_actor_on_a_gpu_the_host_does_not_have_is_refused(tmp_path):
    text = """
[run]
name = "x"
[[hosts]]
name = "a"
address = "10.1.0.1"
gpus = 2
[actors.t]
cls = "actors.inference:InferenceWorker"
config = { model = "tiny", device = "cuda:3" }
"""
    remote_only = text.replace('[actors.t]', '[[hosts]]\nname = "b"\naddress = "10.1.0.2"\n'
                               'exec = ["ssh", "b"]\n[actors.t]\nhost = "b"')
    with pytest.raises(ConfigError, match="the launcher runs on host 'a' and the remote hosts"):
        load(write(tmp_path, remote_only.replace("10.1.0.1", "127.0.0.1")))
    with pytest.raises(ConfigError, match=r"\[actors.t\], field `host`: its device is GPU 3 of "
                                          r"host 'a', which has gpus = 2"):
        load(write(tmp_path, text))
    load(write(tmp_path, text.replace("cuda:3", "cuda:1")))


SCONTROL = """#!/bin/sh
# a stand-in for Slurm's scontrol: `scontrol show hostnames LIST` for LIST = gpu[07-08],cpu1
[ "$1 $2" = "show hostnames" ] || exit 2
[ "$3" = "gpu[07-08],cpu1" ] || { echo "bad list $3" >&2; exit 1; }
printf 'gpu07\\ngpu08\\ncpu1\\n'
"""


def test_hosts_from_slurm_with_a_fake_scontrol(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08],cpu1")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu07")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    path = write(tmp_path, 'hosts = "slurm"\n[run]\nname = "x"\n' + DEMO.format(scaler="#2"))
    notes: list[str] = []
    cfg = load(path, notes=notes)
    assert [(h.name, h.address, h.exec, h.gpus) for h in cfg.hosts] == [
        ("gpu07", "gpu07", [], 4),
        ("gpu08", "gpu08", ["srun", "--nodes=1", "--ntasks=1", "--overlap", "-w", "gpu08"], 4),
        ("cpu1", "cpu1", ["srun", "--nodes=1", "--ntasks=1", "--overlap", "-w", "cpu1"], 4)]
    assert cfg.actors["scaler"].host == "cpu1"
    assert cfg.run.transport == "tcp" and cfg.security.curve is True
    assert "hosts from Slurm: gpu07, gpu08, cpu1 (gpu07 is the launcher's node)" in notes
    # the table form: own srun prefix and interpreter
    path.write_text(path.read_text().replace(
        'hosts = "slurm"', 'hosts = { from = "slurm", srun = ["srun", "-N1"], '
                           'python = "/opt/env/bin/python", gpus = 8 }'))
    cfg = load(path)
    assert cfg.hosts[1].exec == ["srun", "-N1", "-w", "gpu08"]
    assert cfg.hosts[1].python == "/opt/env/bin/python" and cfg.hosts[1].gpus == 8
    # the plan shows the placement per host and how each is reached; its engine check runs
    # one command through each remote host's srun prefix, and srun is not here: said, exit 1
    assert main([str(path), "--dry-run"]) == 1
    out = capsys.readouterr().out
    plan = out[out.index("plan for"):]
    assert max(map(len, plan.splitlines())) <= 80, plan
    assert re.search(r"\n  cpu1 \(cpu1, gpus 8\): started through\n    \$ srun -N1 -w cpu1 sh -c "
                     r"'cd \"\$0\" && exec \"\$1\" -m launch.agent' [^\n]*\\\n[^\n]+\n    runs "
                     r"scaler\n", plan), plan
    assert re.search(r"\n  gpu07 \(gpu07, gpus 8\): the launcher \(this machine\)\n    runs "
                     r"consumer, producer\n", plan), plan
    assert "CURVE on, keys made for the run" in out
    assert "host cpu1: cannot check it (srun is not on PATH here)" in out, out
    assert "host gpu08" not in out  # no actor there: nothing to check
    assert re.search(r"host gpu07: its address gpu07 \(port 0\) does not bind here: gpu07 "
                     r"does not\s+resolve on this machine", out), out
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST is not set"):
        load(path)
