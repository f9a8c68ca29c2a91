"""Test-only: the MoE token dispatcher's CPU stand-ins, now part of
backends/megatron/cpu_shim.py `install()` (kept for the tests that call this module)."""

from __future__ import annotations

from backends.megatron import cpu_shim


def install() -> None:
    cpu_shim.install()


def uninstall() -> None:
    cpu_shim.uninstall()
