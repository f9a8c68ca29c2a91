"""The `sglang` worker type against a stand-in `sglang.launch_server` (tests/fake_sglang_server.py):
the command line that reaches it, health, registration with the real sglang-router, and the
failure paths (an option SGLang does not have, a server that never becomes healthy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from actors.router import RouterActor, RouterConfig
from actors.sglang_worker import SglangWorker, SglangWorkerConfig, server_command
from engine.client import SglangClient
from tests.fake_sglang_server import install
from tests.helpers import context, running

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 5, 6, 7]


@pytest.fixture
def fake_env(tmp_path) -> dict[str, str]:
    """Environment that makes `python -m sglang.launch_server` the stand-in."""
    fake = install(tmp_path / "fake")
    return {"PYTHONPATH": f"{fake}:{ROOT}", "FAKE_SGLANG_RECORD": str(tmp_path / "argv.json"),
            "OMP_NUM_THREADS": "1"}


def worker(ipc, tmp_path, env, name="sg0", peers=None, **cfg) -> SglangWorker:
    config = SglangWorkerConfig(model_path="tiny-qwen2", env=env, **cfg)
    return SglangWorker(context(name, ipc, run_dir=str(tmp_path), peers=peers or {},
                                start_timeout_s=60), config)


async def workers_listed(router_url: str) -> list[str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{router_url}/workers") as r:
            return [w["url"] for w in (await r.json())["workers"]]


def test_server_command_owned_options_then_pass_through():
    cfg = SglangWorkerConfig(model_path="/m", tp_size=2, dp_size=4, python="/py",
                             sglang={"mem_fraction_static": 0.8, "enable_torch_compile": True,
                                     "disable_radix_cache": False, "cuda_graph_bs": [1, 2, 4],
                                     "json_model_override_args": {"a": 1}})
    assert server_command(cfg, 31000) == [
        "/py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
        "--port", "31000", "--tp-size", "2", "--dp-size", "4", "--mem-fraction-static", "0.8",
        "--enable-torch-compile", "--cuda-graph-bs", "1", "2", "4",
        "--json-model-override-args", '{"a": 1}']


@pytest.mark.parametrize("key, field", [("tp_size", "tp_size"), ("model", "model_path"),
                                        ("tp", "tp_size"), ("port", "port"),
                                        ("data_parallel_size", "dp_size")])
def test_project_owned_options_are_refused(key, field):
    with pytest.raises(ValueError) as err:
        SglangWorker.check_config(SglangWorkerConfig(model_path="m", sglang={key: 2}))
    assert f"instead of sglang.{key} set `{field}`" in str(err.value)
    with pytest.raises(ValueError, match="router.worker_urls"):
        RouterActor.check_config(RouterConfig(router={"worker_urls": ["http://x"]}))


async def test_worker_starts_registers_serves_and_deregisters(ipc, tmp_path, fake_env):
    router = RouterActor(context("router", ipc), RouterConfig(
        dynamic_workers=True, policy="round_robin", router={"log_level": "warn"}))
    async with running(router, 60):
        sg = worker(ipc, tmp_path, fake_env, peers={"router": router.bound},
                    register_with="router",
                    sglang={"mem_fraction_static": 0.75, "enable_torch_compile": True,
                            "cuda_graph_bs": [1, 2, 8], "log_level": "warning",
                            "json_model_override_args": {"rope_theta": 5.0}})
        async with running(sg, 60):
            record = json.loads((tmp_path / "argv.json").read_text())
            port = sg.bound.http.rsplit(":", 1)[1]
            assert record["argv"] == [
                "--model-path", "tiny-qwen2", "--host", "127.0.0.1", "--port", port,
                "--tp-size", "1", "--dp-size", "1", "--mem-fraction-static", "0.75",
                "--enable-torch-compile", "--cuda-graph-bs", "1", "2", "8", "--log-level",
                "warning", "--json-model-override-args", '{"rope_theta": 5.0}']
            parsed = record["parsed"]
            assert parsed["cuda_graph_bs"] == [1, 2, 8] and parsed["mem_fraction_static"] == 0.75
            assert json.loads(parsed["json_model_override_args"]) == {"rope_theta": 5.0}
            assert await workers_listed(router.bound.http) == [sg.bound.http]
            client = SglangClient(router.bound.http)
            try:
                out = await client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0.0,
                                                     "ignore_eos": True})
            finally:
                await client.close()
            assert len(out["output_ids"]) == 3
        assert sg.worker_id == ""  # deregistered on stop
        assert await workers_listed(router.bound.http) == []


async def test_unknown_sglang_option_fails_fast_quoting_argparse(ipc, tmp_path, fake_env):
    sg = worker(ipc, tmp_path, fake_env, sglang={"no_such_option": 3})
    assert await sg.serve() == 1
    reason = sg._stop_reason
    assert "error: unrecognized arguments: --no-such-option 3" in reason
    assert str(tmp_path / "logs" / "sg0.sglang.log") in reason


async def test_health_timeout_fails_with_log_path_and_tail(ipc, tmp_path, fake_env):
    sg = worker(ipc, tmp_path, fake_env, sglang={"fake_hang": True}, health_timeout_s=2.0)
    assert await sg.serve() == 1
    reason = sg._stop_reason
    assert "did not answer /health within health_timeout_s = 2" in reason
    assert "loading the model (never finishes)" in reason  # the log tail
    assert str(tmp_path / "logs" / "sg0.sglang.log") in reason
    assert sg.proc.returncode is not None  # the server was stopped


async def test_health_wait_ends_before_the_actor_start_deadline(ipc, tmp_path, fake_env):
    sg = SglangWorker(context("sg1", ipc, run_dir=str(tmp_path), start_timeout_s=4.0),
                      SglangWorkerConfig(model_path="tiny-qwen2", env=fake_env,
                                         sglang={"fake_hang": True}))
    assert await sg.serve() == 1
    assert "within the actor's start_timeout_s = 4 (raise it" in sg._stop_reason
    assert "loading the model (never finishes)" in sg._stop_reason


def test_launcher_passes_sglang_options_and_fails_fast(tmp_path, fake_env):
    """`--sglang-<option>` on the launcher's command line reaches launch_server; an option SGLang
    does not have stops the run with argparse's message and the server's log path."""
    hosts = tmp_path / "hosts.toml"
    env = ", ".join(f'{k} = "{v}"' for k, v in fake_env.items())
    hosts.write_text(f"""
[run]
name = "sg"
dir = "{tmp_path}"
ready_timeout_s = 60

[[hosts]]
name = "local"

[actors.sg0]
cls = "actors.sglang_worker:SglangWorker"
primary = true
restart = {{ max_restarts = 0 }}
config = {{ model_path = "tiny-qwen2", env = {{ {env} }}, sglang = {{ log_level = "warning" }} }}
""")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir", str(run_dir),
         "--sglang-mem-fraction-static", "0.5", "--sglang-no-such-flag"],
        cwd=ROOT, capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "error: unrecognized arguments: --no-such-flag" in out
    assert str(run_dir / "logs" / "sg0.sglang.log") in out
    argv = json.loads((tmp_path / "argv.json").read_text())["argv"]
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.5"
    assert argv[argv.index("--log-level") + 1] == "warning"  # the hosts.toml table, kept
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["actors"]["sg0"]["config"]["sglang"] == {
        "log_level": "warning", "mem_fraction_static": 0.5, "no_such_flag": True}
