"""Helpers for the server tests: short socket paths, a server in a thread, raw protocol clients."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvcli.format import manifest as mf, writing
from kvcli.serve import client, protocol


def short_dir() -> Path:
    """A fresh folder with a short path (unix socket paths are limited to ~104 bytes)."""
    return Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))


class ThreadServer:
    """A kvcli Server running in a thread of the test process (torch already imported: fast)."""

    def __init__(self, path: Path, **warm_args):
        from kvcli.serve.server import Server
        from kvcli.serve.warm import Warm

        self.logs: list[str] = []
        self.server = Server(path, Warm(**warm_args), log=self.logs.append)
        self.server.start(preload=False)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.path = path

    def close(self) -> None:
        self.server.stop(hard=True)
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def raw_request(path: Path, payload: bytes, timeout: float = 60.0) -> list[dict]:
    """Send raw bytes as a request and collect every event line until the server closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        try:
            s.sendall(payload)
        except OSError:
            pass  # the server may close on us before we finish sending garbage
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def ask_events(path: Path, cache: Path, question: str, max_new_tokens: int = 8, **fields) -> list[dict]:
    conn = client.open_request(path, "ask", {"caches": [str(cache)], "questions": [question],
                                             "options": {"max_new_tokens": max_new_tokens}, **fields})
    assert conn is not None
    with conn:
        return list(conn.events())


def install_copy(target: Path, source: Path) -> None:
    """Replace the cache `target` by a copy of `source` through the atomic path prefill uses."""
    with writing.atomic_cache_dir(target, force=True) as tmp:
        for name in sorted(os.listdir(source), key=lambda n: n == mf.MANIFEST_NAME):
            shutil.copyfile(source / name, tmp / name)


def kvcli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "kvcli", *map(str, args)]


def start_server(path: Path, *args, env=None) -> subprocess.Popen:
    """`kvcli serve` as a real process; returns once it answers (bounded wait)."""
    proc = subprocess.Popen(kvcli_cmd("serve", "--socket", path, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        if client.ping(path, timeout=1.0):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not answer within 180 s")


def wait_gone(proc: subprocess.Popen, timeout: float = 60) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


__all__ = ["protocol", "client"]
