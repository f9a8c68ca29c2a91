"""One error root: every exception class the project defines derives from RlxError.

Walks every module of the project (tests/ aside: its fakes may raise what they like) with `ast`,
as tests/test_layers.py does, finds each class whose bases lead to an exception (through the
project's own classes, imports and re-exports), and checks that they also lead to
`transport.errors.RlxError`. Then imports those classes to check which ones end the run
(`recoverable = False`), and runs actors in-process against a stand-in supervisor to check that
an unrecoverable error is reported as `Dead(end_run=True)` and any other as a restartable death.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import collections
import functools
import importlib
from pathlib import Path

import pytest

from engine.errors import (BadRequest, EngineError, EngineHTTPError, EngineUnavailable,
                           SessionFailed, SyncError)
from runtime.actor import Actor, EndRun, Status
from runtime.loading import ConfigError
from tests.helpers import context
from tests.test_layers import modules
from transport.codec import Limits
from transport.errors import RlxError, Unrecoverable, ends_run
from transport.rpc import DeadlineExceeded, RemoteError, RpcServer
from transport.schema import Ack, Dead, Heartbeat, Notice, Ready, Stopped
from transport.sockets import SocketFactory

ROOT_CLASS = "transport.errors.RlxError"
# Exception classes of launch/ that do not derive from RlxError yet: each needs it among its
# bases (StartFailed follows from RunFailed). Take a class off this list once it derives from
# RlxError; the list only shrinks (test_pending_classes_exist_and_still_lack_the_root).
PENDING: set[str] = set()
# the classes that end the run instead of a restart; a new one is a deliberate addition here
UNRECOVERABLE = {"transport.errors.Unrecoverable", "runtime.actor.EndRun"}


# ------------------------------------------------------------------------------------ the walk
class Classes:
    """The classes of a set of modules, each base resolved to a qualified name."""

    def __init__(self, trees: dict[str, tuple[Path, ast.Module]]):
        self.known = set(trees)
        self.defs: dict[str, dict[str, ast.ClassDef]] = {}
        self.bound: dict[str, dict[str, str]] = {}  # module -> local name -> qualified name
        for module, (path, tree) in trees.items():
            self.defs[module] = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
            self.bound[module] = self._imports(module, path, tree)

    def _imports(self, module: str, path: Path, tree: ast.AST) -> dict[str, str]:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        out = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        out[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        out[head] = head
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    out[a.asname or a.name] = f"{base}.{a.name}"
        return out

    def resolve(self, module: str, dotted: str, depth: int = 0) -> str:
        """The qualified name `dotted` means in `module`: "pkg.mod.Class" for a project class
        (followed through re-exports), "builtins.X", or the external dotted name."""
        assert depth < 50, f"import loop resolving {dotted} in {module}"
        head, _, rest = dotted.partition(".")
        if not rest and head in self.defs[module]:
            return f"{module}.{head}"
        if head in self.bound[module]:
            full = self.bound[module][head] + (f".{rest}" if rest else "")
        elif hasattr(builtins, head):
            return f"builtins.{dotted}"
        else:
            return dotted
        owner, _, name = full.rpartition(".")
        if owner in self.known and full not in self.known:
            return self.resolve(owner, name, depth + 1)
        return full

    def bases(self, qualified: str) -> list[str]:
        module, _, name = qualified.rpartition(".")
        return [self.resolve(module, ast.unparse(b.value if isinstance(b, ast.Subscript) else b))
                for b in self.defs[module][name].bases]

    def is_project(self, qualified: str) -> bool:
        module, _, name = qualified.rpartition(".")
        return module in self.defs and name in self.defs[module]

    def ancestors(self, qualified: str) -> set[str]:
        """Every class `qualified` derives from, by name; outside the project, by importing."""
        out, todo = set(), [qualified]
        while todo:
            for base in self.bases(todo.pop()):
                if base in out:
                    continue
                out.add(base)
                if self.is_project(base):
                    todo.append(base)
                else:
                    out |= _external_ancestors(base)
        return out

    def exceptions(self) -> dict[str, set[str]]:
        """Each exception class -> its ancestors."""
        out = {}
        for module, defs in self.defs.items():
            for name in defs:
                ancestors = self.ancestors(f"{module}.{name}")
                if "builtins.BaseException" in ancestors:
                    out[f"{module}.{name}"] = ancestors
        return out


@functools.cache
def _external_ancestors(qualified: str) -> set[str]:
    module, _, name = qualified.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return set()  # not a class that can be seen from here: no exception either
    if not isinstance(cls, type):
        return set()
    return {f"{'builtins' if c.__module__ == 'builtins' else c.__module__}.{c.__qualname__}"
            for c in cls.__mro__}


@functools.cache
def _project_trees() -> dict[str, tuple[Path, ast.Module]]:
    return {m: (p, ast.parse(p.read_text())) for m, p in modules().items()
            if m.split(".")[0] != "tests"}


def project_classes(extra: dict[str, str] | None = None) -> Classes:
    """The classes of every module of the project but tests/, plus `extra` ({name: source})."""
    trees = dict(_project_trees())
    for name, source in (extra or {}).items():
        trees[name] = (Path(name.replace(".", "/") + ".py"), ast.parse(source))
    return Classes(trees)


def outside_the_root(extra: dict[str, str] | None = None) -> set[str]:
    found = project_classes(extra).exceptions()
    return {name for name, ancestors in found.items() if ROOT_CLASS not in ancestors
            and name != ROOT_CLASS}


# ------------------------------------------------------------------------------------ the rule
def test_every_exception_class_derives_from_rlx_error():
    assert outside_the_root() - PENDING == set()


def test_pending_classes_exist_and_still_lack_the_root():
    """A class fixed or gone comes off PENDING, so the list stays exact."""
    assert outside_the_root() & PENDING == PENDING


def test_the_walk_finds_the_known_exception_classes():
    found = project_classes().exceptions()
    for name in ("transport.rpc.DeadlineExceeded", "engine.errors.BadRequest",
                 "runtime.actor.EndRun", "memory.nvme.DiskFullError", "launch.config.PortTaken",
                 "actors.rollout.EpisodeTimeout", "training.teacher_weights._NamesDiffer",
                 "launch.supervisor.StartFailed"):
        assert name in found, name
    assert ROOT_CLASS in found["launch.config.PortTaken"]  # through runtime.loading.ConfigError
    assert "builtins.TimeoutError" in found["transport.rpc.DeadlineExceeded"]
    assert "transport.schema.Msg" not in found  # a struct, no exception
    assert not any(name.startswith("tests.") for name in found)


@pytest.mark.parametrize("source, offender", [
    ("class Oops(ValueError):\n    pass\n", True),
    ("import asyncio\nclass Oops(asyncio.CancelledError):\n    pass\n", True),
    ("class Base(KeyError):\n    pass\nclass Oops(Base):\n    pass\n", True),
    ("def f():\n    class Oops(Exception):\n        pass\n", True),
    ("from transport.errors import RlxError\nclass Oops(RlxError, ValueError):\n    pass\n", False),
    # re-exported: engine.weight_sync imports SyncError from engine.errors
    ("from engine.weight_sync import SyncError\nclass Oops(SyncError):\n    pass\n", False),
    ("from engine import errors as e\nclass Oops(e.EngineError):\n    pass\n", False),
    ("import msgspec\nclass Oops(msgspec.Struct):\n    pass\n", False),  # no exception at all
])
def test_the_walk_catches_a_class_outside_the_root(source, offender):
    found = outside_the_root({"engine._errors_probe": source})
    assert ("engine._errors_probe.Oops" in found) is offender


# ------------------------------------------------------------------------------------ recoverable
def _imported(name: str) -> type:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_only_the_marked_classes_end_the_run():
    names = sorted(set(project_classes().exceptions()) - PENDING)
    classes = {name: _imported(name) for name in names}
    assert all(issubclass(cls, RlxError) for cls in classes.values())
    assert {name for name, cls in classes.items() if not cls.recoverable} == UNRECOVERABLE
    assert EndRun.recoverable is False and issubclass(EndRun, Unrecoverable)
    assert RlxError.recoverable is True


def test_ends_run_reads_the_attribute():
    assert ends_run(EndRun("no data"))
    assert not ends_run(ConfigError("bad field"))
    assert not ends_run(ValueError("not ours"))  # a foreign error: restart, as before
    assert not ends_run(None)

    class Marked(ConfigError):
        recoverable = False

    assert ends_run(Marked("a config no restart can mend"))


def test_builtin_bases_stay():
    """Callers catch some of these by their builtin base."""
    assert issubclass(ConfigError, ValueError)
    assert issubclass(DeadlineExceeded, RemoteError) and issubclass(DeadlineExceeded, TimeoutError)
    assert issubclass(_imported("memory.nvme.DiskFullError"), OSError)
    assert issubclass(_imported("memory.host.HostBudgetError"), ValueError)
    assert issubclass(BadRequest, ValueError)


# ------------------------------------------------------------------------------------ the engine
def test_the_engine_errors_share_one_root():
    for cls in (BadRequest, EngineUnavailable, EngineHTTPError, SyncError, SessionFailed):
        assert issubclass(cls, EngineError) and issubclass(cls, RlxError) and cls.recoverable
    # what callers tell apart stays apart
    assert not issubclass(BadRequest, EngineUnavailable)
    assert not issubclass(EngineUnavailable, BadRequest)
    assert not issubclass(EngineHTTPError, (BadRequest, EngineUnavailable))
    assert BadRequest("too big", 413).status == 413 and BadRequest("no").status == 400
    e = EngineHTTPError(503, "/generate", "busy")
    assert (e.status, e.path, e.message, str(e)) == (503, "/generate", "busy",
                                                       "HTTP 503 from /generate: busy")


# ------------------------------------------------------------------------------------ the runtime
class GaveUp(Unrecoverable):
    """An unrecoverable error of a test actor's own."""


class Raises(Actor):
    """Fails its run with the error given to it."""

    error: BaseException

    async def run(self) -> None:
        await asyncio.sleep(0.05)
        raise self.error


class FakeSupervisor:
    """The launcher's supervisor socket, recording what actors report."""

    def __init__(self, factory: SocketFactory, endpoint: str):
        self.got: list = []
        handlers = {t: self._record for t in (Ready, Heartbeat, Dead, Stopped, Notice)}
        self.server = RpcServer(factory, endpoint, "launcher", handlers, collections.Counter(),
                                Limits(), prefix="supervisor")
        self.endpoint = self.server.sock.last_endpoint.decode()

    def _record(self, msg) -> Ack:
        self.got.append(msg)
        return Ack()


@pytest.mark.parametrize("error, end_run", [
    (EndRun("nothing to train on: the data source is empty"), True),
    (GaveUp("a subclass of Unrecoverable"), True),
    (ConfigError("a recoverable project error"), False),
    (EngineUnavailable("the engine stopped"), False),
    (ValueError("not a project error"), False),
])
async def test_the_runtime_reports_end_run_for_an_unrecoverable_error(ipc, error, end_run):
    factory = SocketFactory()
    supervisor = FakeSupervisor(factory, ipc("sup"))
    serving = asyncio.ensure_future(supervisor.server.serve())
    try:
        actor = Raises(context("quitter", ipc, supervisor=supervisor.endpoint))
        actor.error = error
        assert await asyncio.wait_for(actor.serve(), 10) == 1
        assert actor.status == Status.FAILED
        dead = [m for m in supervisor.got if isinstance(m, Dead)]
        assert len(dead) == 1 and dead[0].actor == "quitter"
        assert dead[0].end_run is end_run
        assert dead[0].error == f"{type(error).__name__}: {error}"
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        supervisor.server.close()
        factory.close()
