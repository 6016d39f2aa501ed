"""Turns on a loaded model: a lock handed to waiters in arrival order (what serve/warm.py lends as the
model's generation turn, taken per batch step or per prefill)."""

from __future__ import annotations

import threading
from collections import deque


class FairLock:
    """A lock handed to waiters in arrival order (threading.Lock promises no order)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._queue: deque[threading.Event] = deque()
        self._held = False

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            turn = threading.Event()
            self._queue.append(turn)
        turn.wait()  # release() hands the lock over directly: it stays held

    def release(self) -> None:
        with self._mutex:
            if self._queue:
                self._queue.popleft().set()
            else:
                self._held = False

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
