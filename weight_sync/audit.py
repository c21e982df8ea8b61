"""Records for an audit of what was pushed and what served (`weight_sync.audit`; bench/chaos.py reads them).

The trainer's sender writes one line per push it starts: (version, update id, live_digest of the
weights as the receivers hold them), before anything is sent, so a push cut short by a crash is on
record too. Each server writes one line per commit (version, update id, live_digest of the weights
that serve from then on, and the wall-clock window of the swap) and one at start-up for weights it
loaded from disk. An auditor holds the two against each other and against the versions the trained
tokens carry (riptide_testing/audit.py, which reads them).
"""
from __future__ import annotations

import json
import os
import threading


class AuditLog:
    """Append-only JSON lines. Each record is one write(2) to a file opened O_APPEND: a process
    killed at any point leaves whole lines (the kernel has them once the call returns)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, **record) -> None:
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

