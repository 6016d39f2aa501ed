"""Replacing a cache is atomic: a kill (SIGKILL), Ctrl-C, full disk or unwritable path at any moment
leaves the old cache or the new one, complete; temporary folders are never read and get cleaned up.

Exact kill points: each prefill runs as a real process whose entry code (STOPPER below) wraps
kvcli/format/writing.py's functions so the writer stops itself (SIGSTOP) at one point, and this test
kills it there; production code has no test hook. Prefills run all at once to keep the wall time
down. KVCLI_TEST_SLOW=1 adds a kill after a seeded delay.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcli.format import store, writing
from kvcli.errors import CacheMissingError

QUESTION = "What does the document say about permissions?"
POINTS = ["tmp-created", "wrote:layer_000.safetensors.zst", "wrote:manifest.json", "before-install", "installed"]
NEW_AFTER = {"installed"}  # points after which the target holds the new cache
SEED = 4242


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """Two documents, the old cache (document A) and a reference of the new one (document B), answers of both."""
    import kvcli
    from kvcli.engine.prefilling import prefill
    from tests.conftest import sample_text

    root = tmp_path_factory.mktemp("atomic")
    text = sample_text()
    doc_a, doc_b = root / "a.txt", root / "b.txt"
    doc_a.write_text(text[:1500], encoding="utf-8")
    doc_b.write_text(text[1500:2700], encoding="utf-8")
    lm = kvcli.load(str(tiny_model_dir))
    old, new = root / "old-ref.kv", root / "new-ref.kv"
    prefill(lm, kvcli.read_document(doc_a), old)
    prefill(lm, kvcli.read_document(doc_b), new)
    w = {"root": root, "doc_a": doc_a, "doc_b": doc_b, "lm": lm, "old": old, "new": new, "model": tiny_model_dir}
    w["answer"] = {"old": answer(w, old), "new": answer(w, new)}
    assert w["answer"]["old"] != w["answer"]["new"]
    w["doc_sha"] = {"old": store.read_manifest(old).document["sha256"], "new": store.read_manifest(new).document["sha256"]}
    return w


def answer(w, cache: Path) -> list[int]:
    import kvcli

    return kvcli.Session(w["lm"], cache).ask(QUESTION, kvcli.GenerationOptions(max_new_tokens=8)).answer_token_ids


def which(w, cache: Path) -> str:
    """'old' or 'new' for a complete, verified cache that answers exactly like that reference; else fail."""
    m = store.verify(cache)
    kind = {sha: k for k, sha in w["doc_sha"].items()}[m.document["sha256"]]
    assert answer(w, cache) == w["answer"][kind], f"{cache} is the {kind} cache but answers differently"
    return kind


def temp_siblings(target: Path) -> list[Path]:
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}{store.TMP_MARK}"))


# Runs `kvcli ARGS...` after wrapping the writer's steps so that it stops itself (SIGSTOP) at POINT:
# "tmp-created", "wrote:<file name>", "before-install", "installed" (new cache in place, old one not yet removed).
STOPPER = """
import os, signal, sys
from kvcli.format import writing

point = sys.argv[1]
real = {name: getattr(writing, name) for name in ("_lock", "write_file", "_install", "_installed")}

def stop(name):
    if name == point:
        os.kill(os.getpid(), signal.SIGSTOP)

def _lock(directory, *, block):
    fd = real["_lock"](directory, block=block)
    if block:  # the writer's own temporary folder, just created and locked
        stop("tmp-created")
    return fd

def write_file(directory, name, data):
    real["write_file"](directory, name, data)
    stop("wrote:" + name)

def _install(tmp, target, *, force):
    stop("before-install")
    return real["_install"](tmp, target, force=force)

def _installed(target):
    real["_installed"](target)
    stop("installed")

writing._lock, writing.write_file, writing._install, writing._installed = _lock, write_file, _install, _installed
sys.argv = ["kvcli", *sys.argv[2:]]
from kvcli.cli import main
main()
"""


def prefill_cmd(w, target: Path, stop_at: str | None = None) -> list[str]:
    args = ["prefill", str(w["doc_b"]), "-o", str(target), "--model", str(w["model"]), "--force", "-q"]
    if stop_at:
        return [sys.executable, "-c", STOPPER, stop_at, *args]
    return [sys.executable, "-m", "kvcli", *args]


def env_with(**extra) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env.update(extra)
    return env


def wait_stopped(procs: dict, deadline: float) -> dict:
    """Wait until each process has stopped itself (SIGSTOP) or exited; {key: 'stopped' | exit code}."""
    state = {}
    while len(state) < len(procs):
        if time.monotonic() > deadline:
            raise AssertionError(f"prefills did not reach their stop points: {sorted(set(procs) - set(state))}")
        for key, p in procs.items():
            if key in state:
                continue
            pid, status = os.waitpid(p.pid, os.WUNTRACED | os.WNOHANG)
            if pid == 0:
                continue
            if os.WIFSTOPPED(status):
                state[key] = "stopped"
            else:
                p.returncode = os.waitstatus_to_exitcode(status)
                state[key] = p.returncode
        time.sleep(0.05)
    return state


KILLS = [("kill", point) for point in POINTS] + [("kill", "delay")] * bool(os.environ.get("KVCLI_TEST_SLOW"))
INTERRUPTS = [("interrupt", "wrote:layer_000.safetensors.zst")]  # Ctrl-C reaches the main thread while a worker writes
FILE_LIMIT = ("file-size-limit", None)


@pytest.fixture(scope="module")
def outcomes(world, tmp_path_factory):
    """Every interrupted prefill, all run at once (one startup cost): {scenario: result}.

    kill: SIGKILL at a stop point (or after a seeded delay); interrupt: SIGINT (Ctrl-C) at a stop
    point; file-size-limit: RLIMIT_FSIZE makes the first shard write fail (EFBIG, like ENOSPC).
    """
    import resource

    w = world
    root = tmp_path_factory.mktemp("interrupted")
    scenarios = KILLS + INTERRUPTS + [FILE_LIMIT]
    targets, procs, results = {}, {}, {}
    for i, sc in enumerate(scenarios):
        folder = root / f"run{i}"
        folder.mkdir()
        targets[sc] = folder / "doc.kv"
        shutil.copytree(w["old"], targets[sc])
    for sc in scenarios:
        kind, point = sc
        stop_at = point if point and point != "delay" else None
        if kind == "file-size-limit":
            limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))  # noqa: E731
        else:  # Ctrl-C as on a terminal, even when the test run itself was started in the background (SIGINT ignored)
            limit = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
        procs[sc] = subprocess.Popen(prefill_cmd(w, targets[sc], stop_at), env=env_with(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, preexec_fn=limit)
    started = time.monotonic()
    hooked = {sc: p for sc, p in procs.items() if sc[1] and sc[1] != "delay"}
    delay = random.Random(SEED).uniform(3.0, 12.0)  # wherever the unhooked prefill happens to be by then
    state = {}
    while len(state) < len(hooked):
        state.update(wait_stopped({sc: p for sc, p in hooked.items() if sc not in state}, time.monotonic() + 300))
    if ("kill", "delay") in procs:
        time.sleep(max(0.0, started + delay - time.monotonic()))
        procs[("kill", "delay")].kill()
    for sc, p in hooked.items():
        if state[sc] != "stopped":
            continue
        results[sc] = {"stale_while_alive": None}
        if sc[0] == "kill":  # while the writer lives (stopped), nobody removes its temporary folder
            writing.clean_stale(targets[sc])
            results[sc]["stale_while_alive"] = bool(temp_siblings(targets[sc]))
            p.kill()
        else:
            p.send_signal(signal.SIGINT)
            p.send_signal(signal.SIGCONT)
    for sc, p in procs.items():
        out, err = p.communicate(timeout=300)
        results.setdefault(sc, {}).update(code=p.returncode, stderr=err.decode(), stopped=state.get(sc), target=targets[sc])
    return results


@pytest.mark.parametrize("scenario", KILLS, ids=[p for _, p in KILLS])
def test_sigkill_leaves_a_complete_cache_and_a_stale_folder_that_is_ignored_then_cleaned(world, outcomes, scenario):
    from kvcli.format import catalog
    from kvcli.documents import read
    from kvcli.engine.prefilling import prefill

    w, r = world, outcomes[scenario]
    point, target = scenario[1], r["target"]
    if point != "delay":
        assert r["stopped"] == "stopped", r["stderr"][-800:]
        assert r["stale_while_alive"], "a live writer's temporary folder was removed"
        assert r["code"] == -signal.SIGKILL
    kind = which(w, target)  # verifies, and answers exactly like the old or the new reference
    if point in NEW_AFTER:
        assert kind == "new"
    elif point != "delay":
        assert kind == "old"
    stale = temp_siblings(target)
    if point != "delay":
        assert stale, "expected the killed run's temporary folder"
    for tmp in stale:  # never read as a cache, never listed
        with pytest.raises(CacheMissingError, match="temporary"):
            store.open_cache(tmp)
        assert not store.is_cache(tmp)
    assert [Path(row["path"]).name for row in catalog.find(target.parent)] == ["doc.kv"]
    # the next prefill of that target removes what the killed one left (its process is gone, its lock released)
    prefill(w["lm"], read(w["doc_a"]), target, force=True)
    assert temp_siblings(target) == []
    assert which(w, target) == "old"


@pytest.mark.parametrize("scenario", INTERRUPTS, ids=[p for _, p in INTERRUPTS])
def test_ctrl_c_keeps_the_old_cache_and_leaves_nothing(world, outcomes, scenario):
    r = outcomes[scenario]
    assert r["stopped"] == "stopped", r["stderr"][-800:]
    assert r["code"] == 130, r["stderr"]
    assert _one_error_line(r["stderr"]) == "kvcli: error: interrupted"
    assert which(world, r["target"]) == "old"
    assert sorted(p.name for p in r["target"].parent.iterdir()) == ["doc.kv"]


def test_file_size_limit_mid_write_is_a_clear_error_and_changes_nothing(world, outcomes):
    """A write that fails halfway (EFBIG here, ENOSPC below) leaves the old cache and no temporary folder."""
    r = outcomes[FILE_LIMIT]
    assert r["code"] == 1, r["stderr"]
    line = _one_error_line(r["stderr"])
    assert str(r["target"]) in line and "File too large" in line and "nothing was changed" in line, line
    assert which(world, r["target"]) == "old"
    assert sorted(p.name for p in r["target"].parent.iterdir()) == ["doc.kv"]


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvcli: error: ") and "Traceback" not in stderr, stderr
    return lines[0]


FULL_DISK_SCRIPT = r"""
import json, os, shutil, subprocess, sys
from pathlib import Path
mnt, old, model, doc, size = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True)
if r.returncode:
    print(json.dumps({"skip": r.stderr.strip()})); sys.exit(0)
shutil.copytree(old, mnt / "doc.kv")
import typer
from click.testing import CliRunner
from kvcli.cli import app
command, runner = typer.main.get_command(app), CliRunner()
def kvcli(*args):
    res = runner.invoke(command, [str(a) for a in args], prog_name="kvcli")
    return {"code": res.exit_code, "stderr": res.stderr}
out = {}
out["full"] = kvcli("prefill", doc, "-o", mnt / "doc.kv", "--model", model, "--force", "-q")
out["after_full"] = sorted(os.listdir(mnt))
out["verify_full"] = kvcli("verify", "-q", mnt / "doc.kv")
subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
out["readonly_new"] = kvcli("prefill", doc, "-o", mnt / "new.kv", "--model", model, "-q")
out["readonly_replace"] = kvcli("prefill", doc, "-o", mnt / "doc.kv", "--model", model, "--force", "-q")
out["after_ro"] = sorted(os.listdir(mnt))
out["verify_ro"] = kvcli("verify", "-q", mnt / "doc.kv")
print(json.dumps(out))
"""


def test_full_disk_and_read_only_filesystem(world, tmp_path):
    """A real ENOSPC and EROFS: a tiny tmpfs in a private mount namespace (skipped where that is not allowed)."""
    import json

    w = world
    if not shutil.which("unshare"):
        pytest.skip("unshare is not available")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    size = store.read_manifest(w["old"]).bytes_stored + 40 * 1024  # the old cache fits, a second copy does not
    cmd = ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", FULL_DISK_SCRIPT,
           str(mnt), str(w["old"]), str(w["model"]), str(w["doc_b"]), str(size)]
    if os.geteuid() == 0:
        cmd = ["unshare", "--mount", "--propagation", "private", *cmd[4:]]
    proc = subprocess.run(cmd, env=env_with(), capture_output=True, text=True, timeout=240)
    if proc.returncode != 0 and "unshare" in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"cannot mount a tmpfs: {out['skip']}")
    full = out["full"]
    assert full["code"] == 1, full
    line = _one_error_line(full["stderr"])
    assert "No space left on device" in line and "nothing was changed" in line, line
    assert out["after_full"] == ["doc.kv"]  # no temporary folder left behind
    assert out["verify_full"]["code"] == 0, out["verify_full"]
    for key in ("readonly_new", "readonly_replace"):
        assert out[key]["code"] == 1, out[key]
        line = _one_error_line(out[key]["stderr"])
        assert "Read-only file system" in line, line
    assert out["after_ro"] == ["doc.kv"] and out["verify_ro"]["code"] == 0, out


def test_unwritable_output_paths(world, tmp_path):
    """Paths that no one (root included) can write: one error line, exit 1, nothing created anywhere."""
    from typer.testing import CliRunner

    from kvcli.cli import app

    w = world
    a_file = tmp_path / "plain-file"
    a_file.write_text("x")
    before = sorted(tmp_path.rglob("*"))
    for out in (a_file / "doc.kv", Path("/proc/kvcli-test-doc.kv"), tmp_path / "missing" / "doc.kv", Path("/proc/self/doc.kv")):
        r = CliRunner().invoke(app, ["prefill", str(w["doc_b"]), "-o", str(out), "--model", str(w["model"]), "-q"])
        assert r.exit_code == 1, (out, r.stderr)
        _one_error_line(r.stderr)
        assert not out.exists()
    assert sorted(tmp_path.rglob("*")) == before
    assert not [p for p in Path("/proc").iterdir() if "kvtmp" in p.name or "kvcli-test" in p.name]


def test_temporary_names_are_never_caches(world, tmp_path):
    from kvcli.documents import read
    from kvcli.errors import KvcliError
    from kvcli.engine.prefilling import prefill

    w = world
    fake = tmp_path / f".doc.kv{store.TMP_MARK}99999999-abcdef12"  # no such process
    shutil.copytree(w["old"], fake)  # a complete cache, but named like a temporary folder
    with pytest.raises(CacheMissingError, match="temporary"):
        store.verify(fake)
    with pytest.raises(KvcliError, match="reserved"):
        prefill(w["lm"], read(w["doc_a"]), tmp_path / f"x{store.TMP_MARK}1.kv")
    # a stale folder whose process is gone is removed by the next prefill of that target
    prefill(w["lm"], read(w["doc_a"]), tmp_path / "doc.kv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.kv"]


def _doc(tmp_path: Path) -> Path:
    from tests.conftest import sample_text

    doc = tmp_path / "same.txt"
    doc.write_text(sample_text()[:1200], encoding="utf-8")
    return doc


def test_a_second_prefill_of_a_cache_being_written_is_refused_before_loading(tmp_path, tiny_model_dir, monkeypatch):
    """Another writer holds the cache's lock (here a thread: any other thread or process counts): the second
    prefill is refused (after BUSY_WAIT_S), with the exit code of an existing cache, and loads no model."""
    import threading

    from kvcli.engine.model import models
    from tests.helpers import assert_clean_error, run

    doc, target = _doc(tmp_path), tmp_path / "same.kv"
    holding, done = threading.Event(), threading.Event()

    def writer():
        with writing.writer_lock(target):
            holding.set()
            done.wait(60)

    thread = threading.Thread(target=writer)
    thread.start()
    holding.wait(60)

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded for a refused prefill")

    monkeypatch.setattr(models, "load", no_load)
    try:
        assert_clean_error(run("prefill", doc, "--model", tiny_model_dir, "--no-server"), 1, str(target), "another prefill")
        assert_clean_error(run("prefill", doc, "--model", tiny_model_dir, "--no-server", "--force"), 1, "another prefill")
    finally:
        done.set()
        thread.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same.txt"]  # the lock went with its writer


def test_a_killed_writers_lock_is_ignored_then_pruned(tmp_path, tiny_model_dir):
    from tests.helpers import run

    doc, target = _doc(tmp_path), tmp_path / "same.kv"
    code = f"import os\nfrom kvcli.format import writing\nheld = writing.writer_lock({str(target)!r})\nheld.__enter__()\nos._exit(9)\n"
    assert subprocess.run([sys.executable, "-c", code], env=env_with(), timeout=120).returncode == 9
    assert writing.lock_path(target).exists()  # a killed writer leaves its lock file, no longer locked
    result = run("prefill", doc, "--model", tiny_model_dir, "--no-server")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same.kv", "same.txt"]
    # prune removes such a lock file, and keeps one whose writer lives
    other = tmp_path / "other.kv"
    assert subprocess.run([sys.executable, "-c", code.replace(str(target), str(other))], env=env_with(), timeout=120).returncode == 9
    with writing.writer_lock(tmp_path / "busy.kv"):
        pruned = run("prune", tmp_path)
        assert pruned.exit_code == 0, pruned.stderr
        assert pruned.stdout.splitlines() == [str(writing.lock_path(other))]
        assert writing.lock_path(tmp_path / "busy.kv").exists()
