"""Model references (models/hub.py): local folders, the packaged examples and hub ids, fetched by
the launcher before anything starts. The hub is a local stand-in server speaking the few calls
huggingface_hub's snapshot_download makes (repo info, tree, resolve); the network is never
used."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from models import hub

ROOT = Path(__file__).resolve().parent.parent
BASE_TINY = ROOT / "examples" / "base-tiny"
SHA = "0123456789abcdef0123456789abcdef01234567"
SHA_V1 = "89abcdef0123456789abcdef0123456789abcdef"


class StandInHub:
    """Serves examples/base-tiny as hub model `org/tiny` (default branch and tag `v1`), with
    the hub's error headers for an unknown repository or revision; counts file downloads."""

    def __init__(self):
        self.files = {p.name: p.read_bytes() for p in BASE_TINY.iterdir() if p.is_file()}
        self.files["flax_model.msgpack"] = b"never fetched"
        self.revisions = {"main": SHA, SHA: SHA, "v1": SHA_V1, SHA_V1: SHA_V1}
        self.downloads: list[str] = []
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub_.answer(self, body=False)

            def do_GET(self):
                hub_.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        parts = [unquote(p) for p in urlparse(h.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"]:  # api/models/org/name/(revision|tree)/<rev>
            repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
            if repo != "org/tiny":
                return self.error(h, "RepoNotFound")
            if rev not in self.revisions:
                return self.error(h, "RevisionNotFound")
            sha = self.revisions[rev]
            doc = ({"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in self.files]}
                   if kind == "revision" else
                   [{"type": "file", "path": f, "size": len(b), "oid": self.etag(b)}
                    for f, b in self.files.items()])
            return self.send(h, json.dumps(doc).encode(), {"Content-Type": "application/json"},
                             body)
        repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        if repo != "org/tiny" or rev not in self.revisions or name not in self.files:
            return self.error(h, "EntryNotFound")
        data = self.files[name]
        if body:
            self.downloads.append(name)
        self.send(h, data, {"X-Repo-Commit": self.revisions[rev], "ETag": f'"{self.etag(data)}"'},
                  body)

    @staticmethod
    def etag(data: bytes) -> str:
        return hashlib.sha1(data).hexdigest()

    @staticmethod
    def send(h, data: bytes, headers: dict, body: bool) -> None:
        h.send_response(200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    @staticmethod
    def error(h, code: str) -> None:
        h.send_response(404)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Length", "0")
        h.end_headers()


@pytest.fixture
def stand_in():
    server = StandInHub()
    yield server
    server.close()


RL = """
[run]
name = "hub"

[rl]
model = "{model}"
num_steps = 1
envs = [{{ cls = "envs.builtin.arith:ArithEnv" }}]
"""


def dry_run(tmp_path: Path, model: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m launch.cluster <file> --dry-run` with `model` in [rl] and the hub's
    environment variables (HF_HOME in tmp_path; no token, no network beyond `env`)."""
    path = tmp_path / "hosts.toml"
    path.write_text(RL.format(model=model))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    clean.update(HF_HOME=str(tmp_path / "hf"), **env)
    return subprocess.run([sys.executable, "-m", "launch.cluster", str(path), "--dry-run"],
                          cwd=ROOT, env=clean, capture_output=True, text=True, timeout=100)


def flat(text: str) -> str:
    """The dry run's text without whitespace (it wraps long lines; these paths have none)."""
    return "".join(text.split())


def test_a_hub_id_is_fetched_once_into_the_cache_then_read_offline(tmp_path, stand_in):
    got = dry_run(tmp_path, "org/tiny", HF_ENDPOINT=stand_in.url)
    assert got.returncode == 0, got.stderr
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / SHA
    assert (snapshot / "model.safetensors").read_bytes() == \
        (BASE_TINY / "model.safetensors").read_bytes()
    assert not (snapshot / "flax_model.msgpack").exists()  # a format no engine here reads
    # every actor that names the model (workers, trainer, rollout) gets the one local folder
    assert f'"model":"{snapshot}"' in flat(got.stdout) and "org/tiny" not in got.stdout
    assert f"model org/tiny: fetching from {stand_in.url}" in got.stderr
    # fetched once, though three actors name it
    assert sorted(stand_in.downloads) == sorted(f for f in stand_in.files if "flax" not in f)

    # offline: the cache alone answers (the stand-in is not asked again)
    stand_in.downloads.clear()
    got = dry_run(tmp_path, "org/tiny", HF_HUB_OFFLINE="1")
    assert got.returncode == 0, got.stderr
    assert f'"model":"{snapshot}"' in flat(got.stdout) and stand_in.downloads == []

    # a revision is a tag, branch or commit after '@'
    got = dry_run(tmp_path, "org/tiny@v1", HF_ENDPOINT=stand_in.url)
    assert got.returncode == 0, got.stderr
    assert f'"model":"{snapshot.parent / SHA_V1}"' in flat(got.stdout)


@pytest.mark.parametrize("model, env, words", [
    ("org/other", {"HF_HUB_OFFLINE": "1"},
     ["'org/other'", "not in the hub cache", "HF_HUB_OFFLINE", "hf download org/other"]),
    ("org/other", {"HF_ENDPOINT": "STAND_IN"},
     ["'org/other'", "no such hub model", "hf auth login"]),
    ("org/tiny@nope", {"HF_ENDPOINT": "STAND_IN"},
     ["'org/tiny@nope'", "no revision 'nope'"]),
    ("org/tiny", {"HF_ENDPOINT": "http://127.0.0.1:9"},  # nothing listens: no network
     ["'org/tiny'", "cannot reach http://127.0.0.1:9", "hf download org/tiny"]),
])
def test_a_hub_id_that_cannot_be_had_is_one_line_saying_what_to_do(tmp_path, stand_in, model,
                                                                     env, words):
    env = {k: stand_in.url if v == "STAND_IN" else v for k, v in env.items()}
    got = dry_run(tmp_path, model, **env)
    assert got.returncode == 2
    error = [line for line in got.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "field actors." in error[0], got.stderr
    for w in words:
        assert w in error[0], error[0]
    assert "Traceback" not in got.stderr


def test_local_names_resolve_next_to_the_file_then_the_working_directory_then_the_examples(
        tmp_path, monkeypatch):
    fetched: dict[str, str] = {}
    # a built-in tiny model and an absolute path stay as written
    assert hub.resolve("tiny-qwen2", tmp_path, fetched) == "tiny-qwen2"
    assert hub.resolve("/nowhere/ckpt", tmp_path, fetched) == "/nowhere/ckpt"
    # the packaged examples, from any folder
    monkeypatch.chdir(tmp_path)
    assert hub.resolve("base-tiny", tmp_path / "cfg", fetched) == str(BASE_TINY)
    # the working directory comes before the examples, the file's folder before both
    shutil.copytree(BASE_TINY, tmp_path / "base-tiny")
    assert hub.resolve("base-tiny", tmp_path / "cfg", fetched) == str(tmp_path / "base-tiny")
    shutil.copytree(BASE_TINY, tmp_path / "cfg" / "base-tiny")
    assert hub.resolve("base-tiny", tmp_path / "cfg", fetched) == \
        str(tmp_path / "cfg" / "base-tiny")
    # neither local nor hub-shaped: kept for the actor's check, which names every place
    assert hub.resolve("no-such-model", tmp_path, fetched) == "no-such-model"
    assert fetched == {}
    from models.load import check_model_path
    with pytest.raises(ValueError, match="packaged examples/.*hub id org/name"):
        check_model_path("no-such-model")


def test_hub_id_shapes():
    assert hub.hub_id("Qwen/Qwen2.5-0.5B") == ("Qwen/Qwen2.5-0.5B", None)
    assert hub.hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for not_hub in ("base-tiny", "a/b/c", "./a/b", "/abs/p", "org/", "-x/y"):
        assert hub.hub_id(not_hub) is None, not_hub
