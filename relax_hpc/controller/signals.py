"""Signals the controller acts on: SIGTERM (scancel, preemption), SIGUSR2 (Slurm's warning before the time
limit, ``--signal=B:USR2@lead``), SIGINT (Ctrl-C in a local run).

Handlers only record the signal; the loop acts on it at its next tick, outside the handler.
"""

from __future__ import annotations

import signal
import threading

WATCHED = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)


class Signals:
    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for sig in WATCHED:
                self._old[sig] = signal.signal(sig, self._on)
        return self

    def _on(self, sig: int, _frame) -> None:
        self.received = self.received or sig

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def take(self) -> str:
        """The name of the signal received since the last take ("" if none), which is then forgotten."""
        name, self.received = self.name, None
        return name

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""
