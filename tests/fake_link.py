"""A fake device link for the restore pipeline's tests: copies run late on a thread of their own, as a CUDA copy
stream does; and a bitwise comparison of restored layers."""

from __future__ import annotations

import queue
import threading
import time

import torch


class FakeLink:
    """A transfer.Link whose 'device' is the CPU: copies are queued to one thread that runs them in order after
    `delay` seconds each (reading the staging buffer only then, as a DMA engine does); events are threading.Events;
    wait() blocks the caller until the event is set (a stream wait, made visible). Every step is logged."""

    pinned = False

    def __init__(self, delay: float = 0.0):
        self.device = torch.device("cpu")
        self.delay = delay
        self.log: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, a, b = item
            if kind == "copy":
                time.sleep(self.delay)
                a.copy_(b)
                self._note("copied", a.data_ptr())
            else:
                a.set()
                self._note("event", a)

    def _note(self, what: str, thing: object) -> None:
        with self._lock:
            self.log.append((what, thing))

    def copy(self, dst, src) -> None:
        self._note("queued", dst.data_ptr())
        self._queue.put(("copy", dst, src))

    def record(self):
        event = threading.Event()
        self._queue.put(("event", event, None))
        return event

    def wait(self, event) -> None:
        event.wait()
        self._note("waited", event)

    def synchronize(self, event) -> None:
        event.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def same_layers(a, b) -> bool:
    return all(x.kind == y.kind and x.seq_length == y.seq_length and torch.equal(bits(x.keys), bits(y.keys))
               and torch.equal(bits(x.values), bits(y.values)) for x, y in zip(a, b, strict=True))
