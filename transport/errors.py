"""The root of every exception class the project defines, and what a failure means for a run.

`RlxError` is the base of them all (tests/test_errors.py walks every module and holds to it), so
`except RlxError` tells the project's own errors from anything else. Each class says whether a
restart can help through the class attribute `recoverable`:

- `recoverable = True` (the default): an actor that fails with it is restarted by the supervisor
  (within its restart budget), as with any other exception escaping an actor.
- `recoverable = False` (`Unrecoverable` and its subclasses, e.g. `runtime.actor.EndRun`): the
  actor reports `Dead(end_run=True)` and the launcher ends the run with its message instead of
  restarting it.

A class keeps the builtin base its callers catch it by (`class ConfigError(RlxError,
ValueError)`). Layer 0 (imports nothing), so every layer can use it.
"""

from __future__ import annotations


class RlxError(Exception):
    """Base of every exception class of the project; `recoverable`: a restart can help."""

    recoverable: bool = True


class Unrecoverable(RlxError):
    """A failure a restart would not mend: the run ends with its message."""

    recoverable = False


def ends_run(error: BaseException | None) -> bool:
    """True when `error` is one of the project's errors marked `recoverable = False`."""
    return isinstance(error, RlxError) and not error.recoverable
