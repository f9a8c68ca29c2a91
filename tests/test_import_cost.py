"""Processes that never touch a tensor do not import torch or transformers (~3 s of CPU each).

Every actor process imports its class's module (python -m runtime.child), and the launcher its
own modules; the buffer, the router and the launcher of a plan without a model run many times
per test run (tests/test_cluster.py starts a launcher per test). Each module is imported in a
fresh interpreter, which reports after each the heavy packages it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ["torch", "transformers", "matplotlib"]
LIGHT = [
    "runtime.child",  # every actor process, before it imports its class
    "actors.buffer",
    "actors.router",
    "launch.cluster",  # the launcher
    "launch.supervisor",
    "launch.config",
    "launch.dryrun",
    "launch.watch",
    "launch.agent",  # the per-host agent of a remote host
    "examples.demo",  # the demo cluster's launcher and consumer (torch: its producer's run)
]


# imports each module in turn, printing after each the heavy packages loaded so far
PROBE = """
import importlib, json, sys
for module in sys.argv[1:]:
    importlib.import_module(module)
    print(json.dumps([module, [m for m in HEAVY if m in sys.modules]]))
"""


def test_light_processes_import_no_tensor_library():
    """One interpreter for all (each would pay its start-up): the first module that loads a heavy
    package is named."""
    out = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}" + PROBE, *LIGHT], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = [json.loads(line) for line in out.stdout.splitlines()]
    assert [m for m, _ in loaded] == LIGHT
    heavy = [(m, h) for m, h in loaded if h]
    assert not heavy, (f"importing {heavy[0][0]} loads {heavy[0][1]}: import it where it is "
                       f"used (python -X importtime -c 'import {heavy[0][0]}' shows who does)")
