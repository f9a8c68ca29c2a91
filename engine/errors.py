"""The engine's errors, one class per thing a caller must tell apart.

Whoever calls an engine (the embedded one, real SGLang, or either through the router) and
whoever serves one sees these:

- `BadRequest`: the request is wrong and sending it again unchanged fails again (HTTP 400, or 413
  for a body over a size limit; `status` says which). The message says what to change.
- `EngineUnavailable`: the engine cannot serve now (its memory is released, it stopped, a
  generation broke, or a server could not be reached after the client's retries): try again
  later or elsewhere. The embedded server answers it with HTTP 503.
- `EngineHTTPError`: a server answered with an HTTP error status (`status`, `path` and the
  server's `message`), as the client sees it.
- `SyncError`: a weight push did not reach every worker, or cannot be made as configured.
- `SessionFailed`: an episode's generation failed (the server's answer was unusable, or
  retries ran out).

All of them derive from `EngineError` (itself a `transport.errors.RlxError`, recoverable: an
actor failing with one is restarted). Each keeps the builtin base its callers catch it by.
"""

from __future__ import annotations

from transport.errors import RlxError


class EngineError(RlxError):
    """Base of the engine's errors."""


class BadRequest(EngineError, ValueError):
    """A malformed request; the message tells the caller what to change. HTTP `status`: 400,
    or 413 for a body over a size limit."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineUnavailable(EngineError, RuntimeError):
    """The engine cannot serve now: memory released (until resumed), stopped, a generation
    that broke, or a server not reached after retries; the message says which."""


class EngineHTTPError(EngineError):
    """The server answered with an HTTP error status."""

    def __init__(self, status: int, path: str, message: str):
        super().__init__(f"HTTP {status} from {path}: {message}")
        self.status, self.path, self.message = status, path, message


class SyncError(EngineError, RuntimeError):
    """A worker refused or missed a weight update (the message names the worker and why), or
    the configured weight-sync path cannot serve the workers."""


class SessionFailed(EngineError, RuntimeError):
    """A turn could not be generated within the retry budget, or the server's answer to it is
    unusable."""


class UnusableAnswer(SessionFailed):
    """The server answered a turn, but the answer cannot be used (a field missing, malformed or
    inconsistent): asking again gets the same, so a rollout whose every episode ends so stops
    (actors/rollout.py max_failed_batches) instead of failing episodes forever."""
