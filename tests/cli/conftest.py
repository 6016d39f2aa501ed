"""Fixtures the command-line tests share."""

from __future__ import annotations

import pytest

from tests.serve_helpers import ThreadServer, short_dir


@pytest.fixture()
def server(monkeypatch):
    """A warm server in a thread of the test process, named by KVCLI_SOCKET for the commands a test runs."""
    s = ThreadServer(short_dir() / "s.sock")
    monkeypatch.setenv("KVCLI_SOCKET", str(s.path))
    yield s
    s.close()
