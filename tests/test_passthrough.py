"""runtime/passthrough.py: `--<prefix>-<option> [value]` -> tables, merged over hosts.toml."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from launch.config import ConfigError, load
from runtime.actor import Actor
from runtime.passthrough import parse, parse_value, refuse_owned, render


class MegatronLikeConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A trainer-like config with a pass-through table."""

    megatron: dict[str, Any] = {}  # megatron-core options


class MegatronLike(Actor):
    Config = MegatronLikeConfig


class PeerNamedConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A config whose `router` field names a peer: not a pass-through table."""

    router: str = "router"  # peer name


class PeerNamed(Actor):
    Config = PeerNamedConfig


HOSTS = """
[run]
name = "t"

[[hosts]]
name = "local"

[actors.trainer]
cls = "tests.test_passthrough:MegatronLike"
config = { megatron = { tensor_model_parallel_size = 1, sequence_parallel = true } }

[actors.router]
cls = "actors.router:RouterActor"
config = { dynamic_workers = true, router = { log_level = "warn" } }

[actors.plain]
cls = "examples.demo:Scaler"

[actors.rollout_like]
cls = "tests.test_passthrough:PeerNamed"
config = { router = "router" }
"""


@pytest.mark.parametrize("text, value", [
    ("2", 2), ("-1", -1), ("0.8", 0.8), ("true", True), ("false", False), ("[1, 2, 4]", [1, 2, 4]),
    ('"x y"', "x y"), ("fa3", "fa3"), ("/models/Qwen3-8B", "/models/Qwen3-8B"),
    ("{ a = 1 }", {"a": 1}), ("1e-4", 1e-4), ("2024-01-02", "2024-01-02"),
])
def test_values_are_toml_where_possible(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_parse_splits_prefixes_flags_values_and_the_rest():
    tables, rest = parse([
        "hosts.toml", "--sglang-mem-fraction-static", "0.8", "--sglang-enable-torch-compile",
        "--router-log-level=warn", "--dry-run", "--megatron-tensor-model-parallel-size", "2",
        "--sglang-cuda-graph-bs", "[1, 2]", "--megatron-lr", "-1e-3", "--run-dir", "r",
        "--sglang-chunked-prefill-size", "4096", "--sglang-chunked-prefill-size", "8192",
        "--sglang-attention-backend=--odd", "--sglang-x"])
    assert rest == ["hosts.toml", "--dry-run", "--run-dir", "r"]
    assert tables == {
        "sglang": {"mem_fraction_static": 0.8, "enable_torch_compile": True,
                   "cuda_graph_bs": [1, 2], "chunked_prefill_size": [4096, 8192],
                   "attention_backend": "--odd", "x": True},
        "router": {"log_level": "warn"},
        "megatron": {"tensor_model_parallel_size": 2, "lr": -1e-3}}


def test_render_is_argparse_style():
    assert render({"a_b": 1, "flag": True, "off": False, "none": None, "bs": [1, 2],
                   "json_args": {"k": [1]}, "s": "x y"}) == [
        "--a-b", "1", "--flag", "--bs", "1", "2", "--json-args", '{"k": [1]}', "--s", "x y"]


def test_refuse_owned_names_the_field_to_set():
    with pytest.raises(ValueError) as err:
        refuse_owned({"port": 1, "ok": 2}, {"port": "port"}, "sglang")
    assert "['port']" in str(err.value) and "instead of sglang.port set `port`" in str(err.value)
    refuse_owned({"ok": 2}, {"port": "port"}, "sglang")


def test_command_line_tables_merge_over_hosts_toml(tmp_path):
    path = tmp_path / "hosts.toml"
    path.write_text(HOSTS)
    tables, _ = parse(["--megatron-tensor-model-parallel-size", "2",
                       "--megatron-recompute-granularity", "selective",
                       "--router-health-check-interval-secs", "5"])
    cfg = load(path, tables)
    assert cfg.actors["trainer"].config["megatron"] == {
        "tensor_model_parallel_size": 2, "sequence_parallel": True,
        "recompute_granularity": "selective"}
    assert cfg.actors["router"].config["router"] == {"log_level": "warn",
                                                     "health_check_interval_secs": 5}
    assert "megatron" not in cfg.actors["plain"].config
    assert cfg.actors["rollout_like"].config == {"router": "router"}  # a str field, not a table
    assert load(path).actors["trainer"].config["megatron"]["tensor_model_parallel_size"] == 1


def test_a_prefix_nobody_takes_and_owned_router_options_fail_at_load(tmp_path):
    path = tmp_path / "hosts.toml"
    path.write_text(HOSTS)
    with pytest.raises(ConfigError) as err:
        load(path, parse(["--sglang-mem-fraction-static", "0.8"])[0])
    assert "--sglang-*" in str(err.value) and "no actor in this file takes a `sglang`" \
        in str(err.value)
    with pytest.raises(ConfigError) as err:
        load(path, parse(["--router-port", "30000"])[0])
    assert "table [actors.router.config]" in str(err.value)
    assert "instead of router.port set `port`" in str(err.value)
