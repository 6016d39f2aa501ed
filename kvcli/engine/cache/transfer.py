"""Moving restored layers to an accelerator: staging buffers in host memory, a copy stream, one event per layer.

A restore onto a device (engine/cache/restore.py) decodes each shard on the host into a staging buffer, hands the
buffer to a `Link` that copies it to the device asynchronously, and gets back an event for that layer. The
layer's compute waits on its own event only (`Link.wait`), so the question's first layers run while later
layers are still decoded or copied. On CUDA the staging buffers are pinned (page-locked) host memory, the
copies run on a stream of their own and the compute stream waits on the event without blocking the host
(`CudaLink`); anything implementing the same four methods works, which is how the pipeline's ordering is tested
on the CPU (tests/engine/test_restore_pipeline.py).

A staging buffer goes back to its pool tagged with its copy's event, and is written again only after that
event completed (`Staging.take` blocks on it): a buffer is never reused under a copy still reading it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Link(Protocol):
    """An asynchronous copier from host staging buffers to one device."""

    device: torch.device
    pinned: bool  # staging buffers should be page-locked (a DMA engine reads them)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue dst.copy_(src) (host -> device) after every copy queued before it; returns at once."""

    def record(self) -> Any:
        """An event that completes once every copy queued so far (by any thread) has completed."""

    def wait(self, event: Any) -> None:
        """Make the computation that follows (the current stream's) wait for `event`; the host need not block."""

    def synchronize(self, event: Any) -> None:
        """Block the host until `event` has completed (before a staging buffer it covers is written again)."""


class CudaLink:
    """Copies on a CUDA stream of their own; events the compute stream waits on."""

    pinned = True

    def __init__(self, device: Any):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._lock = threading.Lock()  # copies and their event recorded from several threads: one order
        self.copy_s = 0.0  # host seconds spent queueing copies (the copies themselves: copy_events)
        self.copy_events: list[tuple[Any, Any, int]] = []  # (start, end, bytes) per queued copy, for rates

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with self._lock, torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            if dst.dtype != src.dtype:  # convert on the device, after a copy in the stored dtype
                tmp = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                tmp.copy_(src, non_blocking=True)
                dst.copy_(tmp)
            else:
                dst.copy_(src, non_blocking=True)
            dst.record_stream(self.stream)  # the allocator reuses dst's memory only after this stream's work on it
            end.record(self.stream)
            self.copy_events.append((start, end, src.numel() * src.element_size()))
        self.copy_s += time.perf_counter() - t0

    def record(self) -> Any:
        with self._lock:
            event = torch.cuda.Event()
            event.record(self.stream)
            return event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def copy_seconds(self) -> float:
        """GPU seconds the queued copies took (each from its start to its end event); waits for them."""
        self.stream.synchronize()
        return sum(s.elapsed_time(e) for s, e, _n in self.copy_events) / 1e3


def link_for(device: Any) -> Link | None:
    """The link a restore onto `device` uses: None on the CPU (shards decode straight into the cache's buffers)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaLink(dev)
    return None


class Staging:
    """Host buffers a layer is decoded into before its copy: at most `count` of `nbytes` each, reused once the
    copy that read one has completed. Pinned where the link asks for it."""

    def __init__(self, nbytes: int, count: int, pinned: bool, synchronize: Callable[[Any], None]):
        self.nbytes, self.count, self.pinned, self._sync = nbytes, max(1, count), pinned, synchronize
        self._free: list[tuple[torch.Tensor, Any]] = []  # (buffer, event of the copy that last read it)
        self._made = 0
        self._cond = threading.Condition()
        self.wait_s = 0.0  # seconds decoders waited for a free buffer (or its copy)

    def take(self) -> torch.Tensor:
        """A buffer no copy reads any more (blocks while all `count` are in use)."""
        t0 = time.perf_counter()
        with self._cond:
            while not self._free and self._made >= self.count:
                self._cond.wait()
            if self._free:
                buf, event = self._free.pop()
            else:
                self._made += 1
                buf, event = None, None
        if buf is None:
            buf = _host_buffer(self.nbytes, self.pinned)
        if event is not None:
            self._sync(event)  # its last copy has read it
        self.wait_s += time.perf_counter() - t0
        return buf

    def give(self, buf: torch.Tensor, event: Any) -> None:
        """Back to the pool once `event` (the copy reading it) completes; not written again before."""
        with self._cond:
            self._free.append((buf, event))
            self._cond.notify()


_POOL_LOCK = threading.Lock()
_POOL: list[tuple[torch.Tensor, Any, Callable[[Any], None]]] = []  # pinned buffers kept for later restores (pinning is
# slow), each with the event of the copy that last read it and how to wait for it
POOL_BYTES = 2 << 30  # pinned staging memory kept between restores, at most


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A uint8 host buffer of at least nbytes; pinned ones come from (and go back to, see release) a pool."""
    if pinned:
        with _POOL_LOCK:
            found = next((i for i, (buf, _e, _s) in enumerate(_POOL) if buf.numel() >= nbytes), None)
            entry = _POOL.pop(found) if found is not None else None
        if entry is not None:
            buf, event, sync = entry
            if event is not None:
                sync(event)
            return buf
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def release(staging: Staging) -> None:
    """Keep a restore's pinned buffers for the next one (up to POOL_BYTES); their copies may still run (the
    next user waits for each one's event), so the host never blocks here."""
    if not staging.pinned:
        return
    with staging._cond:
        bufs = list(staging._free)
        staging._free.clear()
    with _POOL_LOCK:
        kept = sum(b.numel() for b, _e, _s in _POOL)
        for buf, event in bufs:
            if kept + buf.numel() <= POOL_BYTES:
                _POOL.append((buf, event, staging._sync))
                kept += buf.numel()


def views(buf: torch.Tensor, dtype: torch.dtype, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Consecutive tensors of these shapes in `dtype` over the front of a uint8 buffer."""
    out, at = [], 0
    item = torch.empty((), dtype=dtype).element_size()
    for shape in shapes:
        n = item
        for s in shape:
            n *= s
        out.append(buf[at : at + n].view(dtype).view(shape))
        at += n
    return out
