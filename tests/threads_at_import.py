"""An actor whose module starts a thread when imported: a process that imported it is unsafe
to fork from, so the launcher's template refuses it (tests/test_preload.py)."""

from __future__ import annotations

import threading
import time

from tests.misbehaving import Finisher

threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="started-at-import").start()


class FinisherWithThread(Finisher):
    """Completes as tests.misbehaving:Finisher does."""
