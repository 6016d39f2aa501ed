"""`kvcli serve` as a real process: permissions, a second server refused, SIGTERM during an answer,
kill -9 during an answer (and the stale socket it leaves), --detach, --idle-timeout, --stop."""

from __future__ import annotations

import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

import kvcli
from kvcli.serve import client
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, json_lines, run
from tests.serve_helpers import ThreadServer, kvcli_cmd, short_dir, start_server, wait_gone

LONG = 80  # answer tokens: long enough that a signal sent after the first bytes lands mid-answer


@pytest.fixture(scope="module")
def life(tiny_model_dir):
    from kvcli.engine.prefilling import prefill

    root = short_dir()
    (root / "a.txt").write_text(sample_text()[:1400], encoding="utf-8")
    lm = kvcli.load(str(tiny_model_dir))
    prefill(lm, kvcli.read_document(root / "a.txt"), root / "a.kv")
    session = kvcli.Session(lm, root / "a.kv")
    question = next(q for q in ("Go on.", "Tell me more.", "Continue the text.", "Why?", "How?")
                    if session.ask(q, kvcli.GenerationOptions(max_new_tokens=LONG)).finish_reason == "length")
    yield {"root": root, "cache": root / "a.kv", "question": question}
    shutil.rmtree(root, ignore_errors=True)


def long_ask(life, env) -> subprocess.Popen:
    """A `kvcli ask` process with a long answer; returns once its first answer bytes are on stdout."""
    proc = subprocess.Popen(kvcli_cmd("ask", "-c", life["cache"], life["question"], "--max-new-tokens", LONG),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready, "no answer bytes within 120 s"
    return proc


def reference(life) -> bytes:
    result = run("ask", "-c", life["cache"], life["question"], "--max-new-tokens", LONG, "--no-server")
    assert result.exit_code == 0
    return result.stdout.encode()


def test_permissions_second_server_and_sigterm_mid_answer(life, monkeypatch):
    folder = short_dir() / "private"
    sock = folder / "kv.sock"
    env = dict(os.environ, KVCLI_SOCKET=str(sock))
    monkeypatch.setenv("KVCLI_SOCKET", str(sock))
    server = start_server(sock, env=env)
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(sock).st_mode) and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        second = subprocess.run(kvcli_cmd("serve", "--socket", sock), capture_output=True, text=True, timeout=120, env=env)
        assert second.returncode == 1 and "already running" in second.stderr and "Traceback" not in second.stderr
        assert client.ping(sock)["pid"] == server.pid  # the first one is untouched
        asker = long_ask(life, env)
        server.send_signal(signal.SIGTERM)  # mid-answer: the answer is finished, then the server goes
        out, err = asker.communicate(timeout=300)
        assert asker.returncode == 0, err
        assert out == reference(life)
        assert wait_gone(server) == 0
        assert "finishing 1 in-flight request(s)" in server.stderr.read()
        assert not sock.exists()
    finally:
        if server.poll() is None:
            server.kill()


def test_kill_9_mid_answer_then_stale_socket(life, monkeypatch):
    sock = short_dir() / "kv.sock"
    env = dict(os.environ, KVCLI_SOCKET=str(sock))
    monkeypatch.setenv("KVCLI_SOCKET", str(sock))
    server = start_server(sock, env=env)
    try:
        asker = long_ask(life, env)
        server.kill()
        server.wait(timeout=60)
        _, err = asker.communicate(timeout=120)
        err = err.decode()
        assert asker.returncode == 1, err
        assert "Traceback" not in err and [ln for ln in err.splitlines() if ln.startswith("kvcli: error:")] == [err.splitlines()[0]]
        assert len(err.strip().splitlines()) <= 2 and "stopped before" in err  # one error line (and at most a hint)
        assert sock.exists()  # left behind by the dead server
        local = run("ask", "-c", life["cache"], "Q?", "--max-new-tokens", "3", "--json")  # the next ask runs in-process
        assert local.exit_code == 0 and json_lines(local.stdout)[0]["served"] is False
        server = start_server(sock, env=env)  # the stale socket is replaced
        served = run("ask", "-c", life["cache"], "Q?", "--max-new-tokens", "3", "--json")
        assert served.exit_code == 0 and json_lines(served.stdout)[0]["served"] is True
        stop = run("serve", "--stop")
        assert stop.exit_code == 0 and str(server.pid) in stop.stderr
        assert not sock.exists()  # --stop returns once the server has stopped serving and let go of the socket
        assert wait_gone(server) == 0
    finally:
        if server.poll() is None:
            server.kill()


def test_detach_and_idle_timeout(life, monkeypatch):
    home = short_dir()
    sock = home / "kvcli.sock"  # the default place: $KVCLI_HOME/kvcli.sock
    env = {k: v for k, v in os.environ.items() if k != "KVCLI_SOCKET"} | {"KVCLI_HOME": str(home)}
    monkeypatch.delenv("KVCLI_SOCKET")
    monkeypatch.setenv("KVCLI_HOME", str(home))
    started = subprocess.run(kvcli_cmd("serve", "--detach", "--idle-timeout", "3s"), capture_output=True, text=True, timeout=300, env=env)
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout.strip())
    try:
        assert client.ping(sock)["pid"] == pid  # it answers as soon as --detach returns
        assert stat.S_IMODE(os.stat(home).st_mode) == 0o700 and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        served = run("ask", "-c", life["cache"], "Q?", "--max-new-tokens", "3", "--json")
        assert served.exit_code == 0 and json_lines(served.stdout)[0]["served"] is True
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        assert not _alive(pid), "the idle server did not exit"
        assert not sock.exists()
        log = (home / "serve.log").read_text()
        assert f"pid {pid}" in log and "idle for 3 s" in log
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_detach_says_why_the_server_exited(monkeypatch):
    sock = short_dir() / "kv.sock"
    sock.write_text("not a socket")  # the detached server exits at once, saying why in serve.log
    result = run("serve", "--detach", "--socket", sock)
    line = assert_clean_error(result, 1, "exited with code 1 before answering", "exists and is not a socket")
    assert line.count(str(sock)) == 1 and "remove it or choose another --socket" in line
    running = ThreadServer(short_dir() / "kv.sock")  # a server the user started: refused before anything starts
    try:
        result = run("serve", "--detach", "--socket", running.path)
        assert_clean_error(result, 1, f"already running here (pid {os.getpid()})")
        assert "hint: 'kvcli serve --stop' stops it" in result.stderr
    finally:
        running.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (our child, exited) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_autostart_two_shells_get_one_server_that_goes_when_idle(life, monkeypatch):
    home = short_dir()
    sock = home / "kvcli.sock"
    env = {k: v for k, v in os.environ.items() if k not in ("KVCLI_SOCKET", "CI")}
    env |= {"KVCLI_HOME": str(home), "KVCLI_AUTOSTART": "1", "KVCLI_AUTOSTART_IDLE": "4s"}
    cmd = kvcli_cmd("ask", "-c", life["cache"], "Q?", "--max-new-tokens", "3", "--json")
    askers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in askers]
    pid = None
    try:
        assert [p.returncode for p in askers] == [0, 0], results
        assert [json_lines(out)[0]["served"] for out, _ in results] == [True, True]
        started = [ln for _, err in results for ln in err.splitlines() if "started a warm server" in ln]
        assert len(started) == 1, results  # one server for both shells, announced once
        assert "exits after 4s unused" in started[0] and "KVCLI_AUTOSTART=0" in started[0]
        pid = int(started[0].split("(pid ")[1].split(";")[0])
        assert client.ping(sock)["pid"] == pid
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600 and stat.S_IMODE(os.stat(home).st_mode) == 0o700
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        assert not _alive(pid), "the autostarted server did not exit when idle"
        assert not sock.exists()
    finally:
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("setting", [{"CI": "true"}, {"KVCLI_AUTOSTART": "0"}, {"KVCLI_AUTOSTART": "1", "--no-server": ""}])
def test_no_autostart_under_ci_when_off_or_with_no_server(life, monkeypatch, setting):
    home = short_dir()
    monkeypatch.delenv("KVCLI_SOCKET")
    monkeypatch.delenv("KVCLI_AUTOSTART")
    monkeypatch.setenv("KVCLI_HOME", str(home))
    for name, value in setting.items():
        if not name.startswith("--"):
            monkeypatch.setenv(name, value)
    flags = [name for name in setting if name.startswith("--")]
    result = run("ask", "-c", life["cache"], "Q?", "--max-new-tokens", "3", "--json", *flags)
    assert result.exit_code == 0, result.stderr
    assert json_lines(result.stdout)[0]["served"] is False and "started a warm server" not in result.stderr
    assert not (home / "kvcli.sock").exists()


def test_autostart_idle_setting_is_checked(life, monkeypatch):
    monkeypatch.delenv("KVCLI_SOCKET")
    monkeypatch.setenv("KVCLI_HOME", str(short_dir()))
    monkeypatch.setenv("KVCLI_AUTOSTART", "1")
    monkeypatch.setenv("KVCLI_AUTOSTART_IDLE", "soon")
    result = run("ask", "-c", life["cache"], "Q?", "--max-new-tokens", "3")
    assert result.exit_code == 2 and "KVCLI_AUTOSTART_IDLE soon" in result.stderr and "Traceback" not in result.stderr


def test_the_suite_sees_a_server_it_started_even_with_kvcli_settings_cleared():
    """The run's last check (conftest's servers_left) finds a `kvcli serve` this run started, whatever
    environment it was started with (a fuzz worker clears KVCLI_*), and nothing once it is gone."""
    from tests.conftest import servers_left

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCLI_")}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "kvcli", "serve"], env=env)
    try:
        deadline = time.monotonic() + 30
        while proc.pid not in servers_left() and time.monotonic() < deadline:
            time.sleep(0.05)  # its command line appears once it has exec'd
        assert proc.pid in servers_left()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.pid not in servers_left()
