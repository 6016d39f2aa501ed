"""Turns at loading one thing (a model, a restored cache) for the warm server (serve/warm.py): one loader per key,
and a bound on how many requests may wait for one key, past which one more is refused at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class LoadTurns:
    """One loader per key: a second request for the same thing waits, then finds it loaded."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._waiting: dict[str, int] = {}  # key -> requests in its turn or waiting for it

    @contextmanager
    def turn(self, key: str, bound: int | None = None) -> Iterator[None]:
        """The key's turn, held while the body runs. bound: at most this many requests (the loader among them) wait
        for one key; one more is refused at once (EngineBusy), as a model's engine refuses one past its queue:
        waiting for a restore is waiting too."""
        with self._mutex:
            lock = self._locks.setdefault(key, threading.Lock())
            if bound is not None and self._waiting.get(key, 0) >= bound:
                from ..engine.scheduling.requests import EngineBusy

                raise EngineBusy(f"busy: {self._waiting[key]} requests already waiting for this cache to be restored; "
                                 "retry later")
            self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            with lock:
                yield
        finally:
            with self._mutex:
                self._waiting[key] -= 1
                if not self._waiting[key]:
                    del self._waiting[key]
