"""What an agent episode does with a request that does not extend its tokens (a drift), by name:
the rollout's `agent_drift` (engine/session.py applies the rule; docs/agents.md).

A module of its own so that the launcher checks the setting without importing the session (the
rollout's plan class stays free of torch, tests/test_import_cost.py).
"""

from __future__ import annotations

# "split": a new segment starts, the sample is the last one; "fail": the same, marked failed
DRIFT_RULES = ("split", "fail")
