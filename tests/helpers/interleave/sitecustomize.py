"""Loaded at start-up by a Python process whose PYTHONPATH names this directory: with
CACHEFS_TEST_SWITCH_INTERVAL set, its threads take turns at the interpreter lock that often
(seconds), so that a race between two of them, which a loaded machine shows once in hundreds
of runs, shows within seconds."""

import os
import sys

_interval = os.environ.get("CACHEFS_TEST_SWITCH_INTERVAL")
if _interval:
    sys.setswitchinterval(float(_interval))
