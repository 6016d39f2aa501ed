"""The install itself (issue 23): the CPU torch stayed the CPU torch, no CUDA runtime came along, the committed
constraints cover the project's requirements, and the version lives in one place (`kvcli --version` reads it
without importing torch or transformers)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", re.M)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _constraints() -> dict[str, str]:
    return {_norm(n): v for n, v in PIN.findall((ROOT / "constraints.txt").read_text())}


def test_torch_is_the_cpu_build():
    import torch

    assert torch.version.cuda is None, f"a CUDA torch is installed: {torch.__version__} (CUDA {torch.version.cuda})"
    assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not the +cpu build"
    assert torch.__version__ == _constraints()["torch"], "torch is not the version constraints.txt pins"


def test_no_cuda_runtime_packages_are_installed():
    names = sorted({_norm(d.metadata["Name"] or "") for d in metadata.distributions()})
    cuda = [n for n in names if n.startswith("nvidia-") or n in ("triton", "pytorch-triton")]
    assert not cuda, f"CUDA packages in this environment (a CUDA torch was resolved at some point): {cuda}"


def test_constraints_pin_every_requirement_of_the_project():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    names = {_norm(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in reqs} - {"kvcli"}
    pinned = _constraints()
    assert names - pinned.keys() == set(), "regenerate constraints.txt (command at its top)"
    assert pinned["torch"].endswith("+cpu")
    assert not [n for n in pinned if n.startswith("nvidia-") or n == "triton"]
    # one botocore for everything: the boto3 moto uses and the aiobotocore s3fs uses agree (pyproject, test extra)
    boto3, botocore = (tuple(int(x) for x in pinned[n].split(".")) for n in ("boto3", "botocore"))
    assert boto3[:2] == botocore[:2] and botocore >= boto3  # boto3 1.43.N needs botocore >= 1.43.N, < 1.44


def test_version_is_written_once_and_read_without_torch():
    import kvcli

    assert kvcli.__version__ == "0.3.0"
    assert metadata.version("kvcli") == kvcli.__version__, "reinstall (pip install -e .): metadata is stale"
    assert f"## [{kvcli.__version__}]" in (ROOT / "CHANGELOG.md").read_text()
    code = (
        "import sys\n"
        "from kvcli.cli import main\n"
        "sys.argv = ['kvcli', '--version']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == f"kvcli {kvcli.__version__}", out
    assert "heavy: []" in out.stderr, out.stderr


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def test_ci_runs_the_readme_commands_as_written():
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in _sh_blocks(readme.split("## Quick start", 1)[1]) if "python3 -m venv" in b)
    quick = " && ".join(line.strip() for line in block.splitlines() if line.strip())  # one line a command in the README, one && chain in .ci/run
    tests = next(b for b in _sh_blocks(readme.split("## Quick start", 1)[1]) if "pytest" in b).strip()
    assert "\n" not in tests and tests.index("'.[test]'") < tests.index("pytest")  # one line: the test extra, then the suite
    assert "```sh" not in (ROOT / "docs" / "development.md").read_text().split("## Running the tests", 1)[1].split("## ", 1)[0]  # no second copy
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert quick in ci and tests in ci
    assert ci.index(quick) < ci.index(".ci/slurm-up") < ci.index(tests)
    for line in (quick, tests):  # every install goes through the constraints (the CPU torch cannot be replaced)
        installs = [p for p in line.split("&&") if "pip install" in p and " -e " in p]  # kvcli and its requirements
        assert installs and all("-c constraints.txt" in p for p in installs), line
        others = [p for p in line.split("&&") if "pip install" in p and " -e " not in p]
        assert all("--no-deps" in p or re.search(r"install \S+==\S+\s*$", p) for p in others), line  # pinned, alone


def test_every_documented_install_compiles_bytecode():
    pages = [ROOT / "README.md", ROOT / "docs" / "install.md", ROOT / "docs" / "development.md"]
    blocks = [b for page in pages for b in _sh_blocks(page.read_text())]
    installs = [p for b in blocks for line in b.splitlines() for p in line.split("&&") if re.search(r"\buv (pip|tool) install\b", p)]
    assert len(installs) >= 4 and [p for p in installs if "--compile-bytecode" not in p] == []


def test_the_quick_starts_cache_is_ignored_by_git():
    import shutil

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("samples/document.kv/manifest.json", "samples/document.kv/layer_000.safetensors.zst"):
        r = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", path], capture_output=True, timeout=60)
        assert r.returncode == 0, f"{path} is not ignored by .gitignore"
