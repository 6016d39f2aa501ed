"""A real Slurm job array prefills a corpus: 3 tasks, one list, one folder, one valid cache per document.

Needs a single-node Slurm (Debian's slurm-wlm and munge). `.ci/slurm-up` (run by `.ci/run`) installs
and starts one; here the test starts it if it is installed and we are root, and skips otherwise.
Every wait is bounded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcli.format import store
from tests.conftest import sample_text
from tests.helpers import json_lines, REPO

ROOT = REPO
TASKS = 3
LIMIT_S = 300


def _sinfo_up() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state in out for state in ("idle", "mix", "alloc"))


@pytest.fixture(scope="module")
def slurm() -> None:
    if shutil.which("sbatch") is None or shutil.which("slurmctld") is None:
        pytest.skip("Slurm is not installed (as root: .ci/slurm-up installs Debian's slurm-wlm and munge and starts them)")
    if not _sinfo_up():
        if os.geteuid() != 0:
            pytest.skip("Slurm is installed but not running, and starting it needs root (.ci/slurm-up)")
        up = subprocess.run([str(ROOT / ".ci" / "slurm-up")], capture_output=True, text=True, timeout=120)
        if up.returncode != 0 or not _sinfo_up():
            pytest.skip(f"Slurm could not be started: {(up.stderr or up.stdout).strip()[-300:]}")


def submit_array(work: Path, listing: Path, out: Path, model: Path, tag: str) -> None:
    """Submit a 3-task array running kvcli on the list, wait (bounded) for it to finish."""
    script = work / f"prefill-{tag}.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --array=0-{TASKS - 1}\n"
        f"#SBATCH --output={work}/{tag}-%a.log\n"
        f"exec {sys.executable} -m kvcli prefill --from-list {listing} -o {out} --model {model} --json --quiet "
        f"> {work}/{tag}-$SLURM_ARRAY_TASK_ID.jsonl\n",
        encoding="utf-8",
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    sub = subprocess.run(["sbatch", "--parsable", "--export=ALL", f"--chdir={work}", str(script)],
                         capture_output=True, text=True, env=env, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True, timeout=30)
        if q.returncode == 0 and not q.stdout.strip():
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job], timeout=30)
        pytest.fail(f"Slurm array {job} did not finish within {LIMIT_S} s")
    logs = "".join(p.read_text(errors="replace") for p in sorted(work.glob(f"{tag}-*.log")))
    assert "Traceback" not in logs, logs


def results(work: Path, tag: str) -> list[dict]:
    files = sorted(work.glob(f"{tag}-*.jsonl"))
    assert len(files) == TASKS, files
    return [row for f in files for row in json_lines(f.read_text())]


def test_job_array_prefills_each_document_once(slurm, tiny_model_dir, tmp_path):
    docs_dir, out = tmp_path / "docs", tmp_path / "caches"
    docs_dir.mkdir()
    out.mkdir()
    text = sample_text()
    docs = []
    for i in range(5):
        p = docs_dir / f"part{i}.txt"
        p.write_text(text[i * 250 : i * 250 + 300], encoding="utf-8")
        docs.append(p)
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(map(str, docs)) + "\n", encoding="utf-8")

    submit_array(tmp_path, listing, out, tiny_model_dir, "first")
    rows = results(tmp_path, "first")
    assert sorted(Path(r["document"]).name for r in rows) == [d.name for d in docs]  # each exactly once across tasks
    assert {r["status"] for r in rows} == {"built"}
    assert sorted(p.name for p in out.iterdir()) == [f"part{i}.kv" for i in range(5)]  # nothing else left behind
    for d in docs:
        m = store.verify(out / f"{d.stem}.kv")
        assert m.document["sha256"] == hashlib.sha256(d.read_bytes()).hexdigest()

    submit_array(tmp_path, listing, out, tiny_model_dir, "again")  # the same array again: nothing to do
    assert sorted(r["status"] for r in results(tmp_path, "again")) == ["skipped"] * 5
