"""Shared fixtures: an isolated KVCLI_HOME, the real tokenizer, tiny random models, the default model."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the model hub
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of the README test command's parallel workers (as many as cores):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one torch thread each, so no worker's OpenMP spins against another's
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["KVCLI_AUTOSTART"] = "0"  # module fixtures start kvcli processes before any test runs: none may start a background server
os.environ["KVCLI_SOCKET"] = os.path.join(tempfile.gettempdir(), f"kvcli-tests-{os.getpid()}-none.sock")  # and never reach a running one
if not (os.environ.get("PYTEST_CURRENT_TEST") and os.environ.get("PYTEST_KVCLI_RUN")):  # a process a test started keeps its run's
    os.environ["PYTEST_KVCLI_RUN"] = f"{uuid.uuid4().hex}-{os.getpid()}"  # carried by every process started, KVCLI_* cleared or not
RUN_TAG = os.environ["PYTEST_KVCLI_RUN"]
SAMPLES = Path(__file__).resolve().parent.parent / "samples"
collect_ignore = ["bench"]  # development benchmarks and scripts, each run as a file: python tests/bench/NAME.py


@pytest.fixture(scope="session")
def session_home(tmp_path_factory) -> Path:
    """A KVCLI_HOME shared by the whole test session (KVCLI_TEST_HOME reuses one across sessions)."""
    home = Path(os.environ["KVCLI_TEST_HOME"]) if os.environ.get("KVCLI_TEST_HOME") else tmp_path_factory.mktemp("kvcli-home")
    home.mkdir(parents=True, exist_ok=True)
    return home


def servers_left() -> list[int]:
    """The pids of the kvcli servers still running that this test process started (their environment carries
    RUN_TAG), however they were started: by a test, or by a command that started one by itself."""
    tag, found = f"PYTEST_KVCLI_RUN={RUN_TAG}".encode(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            if b"serve" not in args or not any(a == b"kvcli" or a.endswith(b"/kvcli") for a in args):
                continue
            if tag in Path(entry.path, "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def _no_server_left_behind():
    """A test run leaves no kvcli server running: one still up once every test is done (a moment given to
    those stopping) fails the run and is stopped here."""
    yield
    deadline = time.monotonic() + 10
    while (left := servers_left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"kvcli servers left running by this test run (stopped now): pids {left}"


@pytest.fixture(autouse=True)
def _isolated_home(session_home, monkeypatch):
    monkeypatch.setenv("KVCLI_HOME", str(session_home))
    monkeypatch.delenv("KVCLI_MODEL", raising=False)
    monkeypatch.delenv("KVCLI_DEBUG", raising=False)
    monkeypatch.setenv("KVCLI_SOCKET", str(session_home / "no-server-here.sock"))  # never a developer's running server
    monkeypatch.setenv("KVCLI_AUTOSTART", "0")  # no test starts a background server unless it asks to


@pytest.fixture(scope="session")
def tokenizer_dir(session_home) -> Path:
    """The real SmolLM2 tokenizer (with its chat template), saved once as a plain folder."""
    folder = session_home / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        from kvcli.engine.model.models import default_gguf_path

        gguf = default_gguf_path()
        tmp = session_home / f".tokenizer-{os.getpid()}"
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def plain_tokenizer(tokenizer_dir):
    """The same tokenizer without a chat template: exercises the plain framing."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = None
    return tok


def tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    """A 2-layer llama with grouped-query attention and random weights (initializer_range 0.1)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, initializer_range=0.1,
    )
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


@pytest.fixture(scope="session")
def tiny_lm(tokenizer):
    """kvcli's wrapper around a tiny llama that uses the real tokenizer and chat template."""
    import kvcli

    return kvcli.from_objects(tiny_llama(len(tokenizer)), tokenizer, name="tiny-llama")


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory) -> Path:
    """The tiny llama saved as a transformers folder, for CLI tests (--model DIR)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def short_model_dir(tokenizer, tmp_path_factory) -> Path:
    """A tiny llama folder with only 1,024 positions: documents that do not fit it are refused."""
    folder = tmp_path_factory.mktemp("short-llama")
    tiny_llama(len(tokenizer), max_position_embeddings=1024).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_lm(session_home):
    """The real default model (converted once per session into the session's KVCLI_HOME)."""
    import kvcli

    old = os.environ.get("KVCLI_HOME")
    os.environ["KVCLI_HOME"] = str(session_home)
    try:
        return kvcli.load()
    finally:
        if old is None:
            os.environ.pop("KVCLI_HOME", None)
        else:
            os.environ["KVCLI_HOME"] = old


def reference_answer(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy answer ids from generate() on the full prompt with no cache: the ground truth.

    Run with transformers' own attention (sdpa or eager), not the kvcli function selected for the model."""
    import torch

    from kvcli.engine.model.attention import kernel_name

    was = model.config._attn_implementation
    if was.startswith("kvcli"):
        model.set_attn_implementation(kernel_name(was))
    try:
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
    finally:
        if model.config._attn_implementation != was:
            model.set_attn_implementation(was)
    return out[0, len(prompt_ids):].tolist()


class TokenCounter:
    """Counts the token positions a model actually runs forward (a forward pre-hook)."""

    def __init__(self, model):
        self.calls: list[int] = []
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is not None:
            self.calls.append(int(ids.shape[-1]))

    @property
    def total(self) -> int:
        return sum(self.calls)

    def reset(self) -> None:
        self.calls.clear()

    def close(self) -> None:
        self._hook.remove()


def sample_text(min_chars: int = 0) -> str:
    """The sample document (repeated if a test needs it longer)."""
    text = (SAMPLES / "document.txt").read_text(encoding="utf-8")
    while len(text) < min_chars:
        text += "\n\n" + text
    return text


_EXACTNESS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def exactness_report(request) -> list[str]:
    """Lines a test adds here (measured logit differences) are printed in pytest's terminal summary."""
    return request.config.stash.setdefault(_EXACTNESS, [])


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(_EXACTNESS, [])
    if lines:
        terminalreporter.section("exactness measured (cached path vs one forward without cache)")
        for line in lines:
            terminalreporter.write_line(line)


# A tiny cache of the sample's first 2,500 characters, made once per test module that asks for it (module
# scope: a module may change or remove it). A module's own fixture of the same name takes precedence.
@pytest.fixture(scope="module")
def here(tmp_path_factory, request):
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))


@pytest.fixture(scope="module")
def doc_file(here):
    path = here / "lic.txt"
    path.write_text(sample_text()[:2500], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache_dir(doc_file, tiny_model_dir):
    from tests.helpers import run

    result = run("prefill", doc_file, "--model", tiny_model_dir)
    assert result.exit_code == 0, result.stderr
    return doc_file.with_suffix(".kv")


@pytest.fixture(scope="module")
def arch(tokenizer, plain_tokenizer, tmp_path_factory):
    """arch(name): the tiny model of that type (tests/architectures.py), wrapped, with one document prefilled
    (built once per module)."""
    from types import SimpleNamespace

    import kvcli
    from kvcli.documents import decode
    from kvcli.engine.prefilling import prefill
    from tests.architectures import ARCHS, CHUNK, DOC_CHARS, build

    built: dict[str, SimpleNamespace] = {}

    def get(name: str) -> SimpleNamespace:
        if name not in built:
            tok = plain_tokenizer if ARCHS[name][1] else tokenizer
            model = build(name, tok)
            lm = kvcli.from_objects(model, tok, name=f"tiny-{name}")
            path = tmp_path_factory.mktemp(name) / "doc.kv"
            doc = decode(sample_text()[:DOC_CHARS].encode(), "licence.txt")
            result = prefill(lm, doc, path, chunk_size=CHUNK)
            built[name] = SimpleNamespace(name=name, model=model, tok=tok, lm=lm, path=path, doc=doc,
                                          manifest=result.manifest, plan=ARCHS[name][2])
        return built[name]

    return get


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_model_dir):
    """A small cache of the tiny model, prefilled by the CLI: what the fuzz and crafted-cache tests mutate."""
    from tests.helpers import run

    root = tmp_path_factory.mktemp("fuzz-pristine")
    doc = root / "doc.txt"
    doc.write_text(sample_text()[:1200], encoding="utf-8")
    cache = root / "pristine.kv"
    r = run("prefill", doc, "-o", cache, "--model", tiny_model_dir)
    assert r.exit_code == 0, r.stderr
    return cache


@pytest.fixture(scope="module")
def pristine_q(pristine, tiny_model_dir, tmp_path_factory):
    """The same document stored 4-bit with both exact regions (the quantized layout: first and last tokens
    exact, packed codes, float16 scales), whatever prefill's defaults for them are."""
    import kvcli

    cache = tmp_path_factory.mktemp("fuzz-pristine-q4") / "pristine-q4.kv"
    kvcli.prefill(kvcli.load(str(tiny_model_dir)), kvcli.read_document(pristine.parent / "doc.txt"), cache, kv_bits=4,
                  exact_tokens=4, recent_tokens=16)
    return cache
