"""Small helpers for CLI tests: run kvcli through typer's runner and check the stdout/stderr split."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from kvcli.cli import app

REPO = Path(__file__).resolve().parent.parent  # the repository's root, where kvcli/ and samples/ are

runner = CliRunner()

# the one record every prefill reports (docs/scripting.md)
PREFILL_RECORD = {"document", "cache", "status", "num_tokens", "compute_s", "write_s", "bytes_raw", "bytes_on_disk", "storage",
                  "seconds", "computed_tokens", "extended_from", "base", "error", "format", "sections", "served"}


def run(*args: str, input: str | None = None, env: dict | None = None):
    """Invoke kvcli in-process; returns click's Result (stdout, stderr, exit_code)."""
    return runner.invoke(app, [str(a) for a in args], input=input, env=env)


def served_and_local(*args: str, input: str | None = None):
    """The same command through the warm server KVCLI_SOCKET names and in-process: (served, local) Results."""
    return run(*args, "--server", input=input), run(*args, "--no-server", input=input)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("kvcli: error:")]


def assert_clean_error(result, code: int, *needles: str) -> str:
    """Exit code as documented, exactly one error line naming what is wrong, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert result.stdout == ""
    return lines[0]


def piped(answers: list[dict], several_caches: bool = False) -> str:
    """What `kvcli ask` prints on a pipe for these `--json` answers: each after its `==> QUESTION <==` line."""
    from kvcli.cli.rendering import separator

    if len(answers) == 1:
        return answers[0]["answer"] + "\n"
    return "".join(separator(f"{a['cache']}: {a['question']}" if several_caches else a["question"], i == 0) + a["answer"] + "\n"
                   for i, a in enumerate(answers))


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def as_format_version(cache, version: int) -> dict:
    """Rewrite a cache's manifest as format `version` wrote it (1, 2: sha256 shard digests; 3: BLAKE3), its
    digests recomputed from the shards and its checksum renewed; returns the new body. Nothing else changes,
    so a version 1 cache must be lossless and a version 2 cache quantized."""
    from pathlib import Path

    from kvcli.format import manifest as mf, store

    path = Path(cache)
    body = json.loads((path / mf.MANIFEST_NAME).read_text())
    old, new = mf.SHARD_HASHES[body["format_version"]], mf.SHARD_HASHES[version]
    for layer in body["layers"]:
        del layer[old]
        layer[new] = store.shard_digest((path / layer["file"]).read_bytes(), new)
    body["format_version"] = version
    body["manifest_sha256"] = mf.checksum(body)
    (path / mf.MANIFEST_NAME).write_text(json.dumps(body))
    return body


def converted_default_model(home) -> Path:
    """The default GGUF's converted transformers folder under a KVCLI_HOME (gguf-<16 hex digits>; its -config, -q4
    and -gguf siblings left out)."""
    import re

    (folder,) = [f for f in (Path(home) / "models").glob("gguf-*") if re.fullmatch(r"gguf-[0-9a-f]{16}", f.name)]
    return folder


def wait_until(condition, timeout: float = 60.0) -> None:
    """Poll `condition` every 5 ms until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
