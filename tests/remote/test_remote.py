"""Caches in object stores: an S3-compatible server (moto's, from the `moto[server]` test extra) on
127.0.0.1, plain HTTP for the read-only schemes, fsspec's memory:// for the local store's bound.

Round trips through prefill/ls/info/verify/ask, a killed upload leaving no readable cache, a shard
altered in the bucket refused (exit 3), a second ask that downloads nothing, and the plain CLI
never importing fsspec. Bytes fetched are counted by a relay in front of moto: a cache of another
model, or one over the local store's bound, costs its manifest only; a shard longer than its
manifest says is never fetched past it.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from kvcli.errors import UsageError
from kvcli.remote import local_store
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, json_lines, run, run_python

QUESTION = "Who may grant a license?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 and the environment every AWS client reads (no real credentials)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[remote]')")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=f, stderr=f)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    os.environ.update(env)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"moto's S3 server did not start: {log.read_text()[-500:]}")
                time.sleep(0.2)
        import s3fs

        yield s3fs.S3FileSystem(skip_instance_cache=True)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def bucket(s3) -> str:
    name = f"kvcli-{uuid.uuid4().hex[:10]}"
    s3.mkdir(name)
    return name


@pytest.fixture
def store_home(tmp_path, monkeypatch) -> Path:
    """A fresh KVCLI_HOME, so the local store starts empty."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVCLI_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("remote-docs")
    text = sample_text()
    out = []
    for i, chars in enumerate((700, 1000)):
        p = folder / f"doc{i}.txt"
        p.write_text(text[i * 500 : i * 500 + chars], encoding="utf-8")
        out.append(p)
    return out


def answer_ids(cache: str, *extra: str) -> list[int]:
    result = run("ask", "--cache", cache, QUESTION, "--max-new-tokens", "6", "--json", *extra)
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    assert a["cache"] == cache
    return a["answer_token_ids"]


def stopped(proc: subprocess.Popen, limit: float = 180) -> bool:
    """Wait (bounded) until the process stops itself at its test point."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        time.sleep(0.1)
    return False


def test_round_trip_and_no_second_download(s3, bucket, docs, tiny_model_dir, tmp_path, store_home):
    prefix = f"s3://{bucket}/caches/"
    built = run("prefill", *docs, "-o", prefix, "--model", tiny_model_dir, "--json")
    assert built.exit_code == 0, built.stderr
    assert [r["status"] for r in json_lines(built.stdout)] == ["built", "built"]
    names = sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{bucket}/caches/doc0.kv"))
    assert names == ["layer_000.safetensors.zst", "layer_001.safetensors.zst", "manifest.json"]

    listed = run("ls", prefix, "--json")
    assert listed.exit_code == 0, listed.stderr
    assert [r["path"] for r in json.loads(listed.stdout)] == [f"{prefix}doc0.kv", f"{prefix}doc1.kv"]
    info = run("info", f"{prefix}doc0.kv", "--json")
    assert info.exit_code == 0 and '"num_tokens"' in info.stdout
    assert not local_store.root().exists()  # ls and info read manifests only
    verified = run("verify", f"{prefix}doc0.kv", f"{prefix}doc1.kv", "--json")
    assert verified.exit_code == 0, verified.stderr
    assert [r["ok"] for r in json_lines(verified.stdout)] == [True, True]

    local = tmp_path / "doc0.kv"
    assert run("prefill", docs[0], "-o", local, "--model", tiny_model_dir).exit_code == 0
    expected = answer_ids(str(local))
    assert answer_ids(f"{prefix}doc0.kv") == expected  # from the object store, token for token
    assert len(local_store.entries()) == 1  # verify read the bucket itself; ask stored one copy

    for key in s3.ls(f"{bucket}/caches/doc0.kv"):  # shards gone from the bucket: a second ask must not need them
        if "layer_" in key:
            s3.rm(key)
    assert answer_ids(f"{prefix}doc0.kv") == expected
    gone = run("verify", f"{prefix}doc0.kv")  # verify checks the bucket, not the local copy
    assert gone.exit_code == 3 and "layer_000.safetensors.zst: shard is missing" in gone.stderr

    assert_clean_error(run("ls", f"s3://{bucket}-missing/"), 1, "no such folder")
    assert_clean_error(run("info", f"{prefix}none.kv"), 3, "no manifest.json")
    again = run("prefill", docs[0], "-o", f"{prefix}doc0.kv", "--model", tiny_model_dir)
    assert again.exit_code == 1 and "already exists (use --force" in again.stderr


def test_kv_bits_prefill_to_a_bucket(s3, bucket, docs, tiny_model_dir, tmp_path, store_home):
    """--kv-bits with a URL: the bucket holds a 4-bit cache that verifies and answers like a local one."""
    url = f"s3://{bucket}/q4/doc0.kv"
    built = run("prefill", docs[0], "-o", url, "--model", tiny_model_dir, "--kv-bits", "4", "--json")
    assert built.exit_code == 0, built.stderr
    verified = run("verify", url, "--json")
    assert verified.exit_code == 0 and json_lines(verified.stdout)[0]["storage"] == "4-bit", verified.stderr
    local = tmp_path / "doc0-q4.kv"
    assert run("prefill", docs[0], "-o", local, "--model", tiny_model_dir, "--kv-bits", "4").exit_code == 0
    assert answer_ids(url) == answer_ids(str(local))


def test_sectioned_cache_in_a_bucket(s3, bucket, tiny_model_dir, tmp_path, store_home):
    """A document longer than the window prefilled into the bucket: its sections' folders uploaded with it; info lists
    them, verify checks every section's shards, and ask answers from the same sections as the bucket's files copied
    here by s3fs itself; a second prefill of it is up to date; a damaged section is named."""
    doc = tmp_path / "long.txt"
    doc.write_text(sample_text(), encoding="utf-8")
    url = f"s3://{bucket}/sec/long.kv"
    built = run("prefill", doc, "-o", url, "--model", tiny_model_dir, "--window", "1024", "--json")
    assert built.exit_code == 0, built.stderr
    sections = sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{bucket}/sec/long.kv") if p.rsplit("/", 1)[1].startswith("s0"))
    assert len(sections) == len(json.loads(run("info", url, "--json").stdout)["sections"]) > 1
    local = tmp_path / "long.kv"
    s3.get(f"{bucket}/sec/long.kv/", str(local), recursive=True)
    assert sorted(p.name for p in local.iterdir() if p.is_dir()) == sections
    info, here = run("info", url, "--json"), run("info", local, "--json")
    assert info.exit_code == 0, info.stderr
    assert json.loads(info.stdout)["sections"] == json.loads(here.stdout)["sections"]
    verified = run("verify", url, "--json")
    assert verified.exit_code == 0 and json_lines(verified.stdout)[0]["ok"] is True, verified.stderr
    for extra in ((), ("--sections", "1")):
        asked = run("ask", "--cache", url, QUESTION, "--max-new-tokens", "6", "--json", *extra)
        assert asked.exit_code == 0, asked.stderr
        want = run("ask", "--cache", local, QUESTION, "--max-new-tokens", "6", "--json", "--no-server", *extra)
        (got,), (alone,) = json_lines(asked.stdout), json_lines(want.stdout)
        assert got["answer_token_ids"] == alone["answer_token_ids"] and got["sources"] == alone["sources"]
    assert len(local_store.entries()) == 1  # one copy, its sections with it
    listing = tmp_path / "list.txt"
    listing.write_text(f"{doc}\n", encoding="utf-8")

    def status() -> str:
        result = run("prefill", "--from-list", listing, "-o", f"s3://{bucket}/sec/", "--model", tiny_model_dir,
                     "--window", "1024", "--json")
        assert result.exit_code == 0, result.stderr
        return json_lines(result.stdout)[0]["status"]

    assert status() == "skipped"
    s3.rm(f"{bucket}/sec/long.kv/{sections[-1]}/layer_001.safetensors.zst")  # a section incomplete: rebuilt
    assert status() == "built"
    s3.pipe(f"{bucket}/sec/long.kv/{sections[-1]}/layer_000.safetensors.zst", b"not the shard")  # altered: named
    broken = run("verify", url)
    assert broken.exit_code == 3 and f"section {len(sections) - 1} (lines" in broken.stderr, broken.stderr
    doc.write_text(sample_text()[:1500], encoding="utf-8")  # within the window: one prompt, no sections
    replaced = run("prefill", doc, "-o", url, "--model", tiny_model_dir, "--window", "1024", "--force")
    assert replaced.exit_code == 0, replaced.stderr
    assert sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{bucket}/sec/long.kv")) == [
        "layer_000.safetensors.zst", "layer_001.safetensors.zst", "manifest.json"]  # no section of the old one left
    assert run("verify", url).exit_code == 0


# Runs `kvcli ARGS...` with the object store's put_file wrapped so the process stops itself (SIGSTOP) right
# after uploading the file named by the first argument: production code has no test hook.
STOP_AFTER_UPLOAD = """
import os, signal, sys
from kvcli.remote import objects

point, real = sys.argv[1], objects.filesystem

def filesystem(url):
    fs, root = real(url)
    put = fs.put_file

    def put_file(lpath, rpath, *args, **kwargs):
        put(lpath, rpath, *args, **kwargs)
        if os.path.basename(str(rpath)) == point:
            os.kill(os.getpid(), signal.SIGSTOP)

    fs.put_file = put_file
    return fs, root

objects.filesystem = filesystem
sys.argv = ["kvcli", *sys.argv[2:]]
from kvcli.cli import main
main()
"""


def test_killed_upload_leaves_no_readable_cache(s3, bucket, docs, tiny_model_dir, store_home):
    """Two uploads killed after their shards, before their manifests (run at once to save time): a first
    upload, and a replacement of a complete cache. Neither leaves a cache a reader can open."""
    fresh, replaced = f"s3://{bucket}/k/fresh.kv", f"s3://{bucket}/k/replaced.kv"
    assert run("prefill", docs[0], "-o", replaced, "--model", tiny_model_dir).exit_code == 0
    good = answer_ids(replaced)
    procs = [subprocess.Popen([sys.executable, "-c", STOP_AFTER_UPLOAD, "layer_001.safetensors.zst", "prefill", str(docs[i]), "-o", url,
                               "--model", str(tiny_model_dir), "-q", *flags],
                              env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i, url, flags in ((1, fresh, []), (1, replaced, ["--force"]))]
    try:
        for proc in procs:
            assert stopped(proc), proc.stderr.read() if proc.poll() is not None else "did not reach the test point"
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    for url in (fresh, replaced):
        assert any("layer_001" in k for k in s3.ls(url[len("s3://"):]))  # the shards are there, the manifest is not
        assert_clean_error(run("info", url), 3, "no manifest.json")
        assert_clean_error(run("ask", "--cache", url, QUESTION), 3, "no manifest.json")
    assert run("prefill", docs[0], "-o", replaced, "--model", tiny_model_dir, "--force").exit_code == 0
    assert answer_ids(replaced) == good


def test_altered_shard_in_the_bucket_is_refused(s3, bucket, docs, tiny_model_dir, store_home):
    url = f"s3://{bucket}/a/doc1.kv"
    assert run("prefill", docs[1], "-o", url, "--model", tiny_model_dir).exit_code == 0
    key = f"{bucket}/a/doc1.kv/layer_001.safetensors.zst"
    data = bytearray(s3.cat_file(key))
    data[len(data) // 2] ^= 0x01
    s3.pipe_file(key, bytes(data))
    assert_clean_error(run("ask", "--cache", url, QUESTION), 3, "layer_001.safetensors.zst", "checksum mismatch")
    bad = run("verify", url)
    assert bad.exit_code == 3 and "checksum mismatch" in bad.stderr
    s3.pipe_file(key, bytes(data[:-10]))  # truncated
    assert_clean_error(run("ask", "--cache", url, QUESTION), 3, "layer_001.safetensors.zst", "manifest says")
    assert not local_store.entries()  # nothing damaged was stored


def test_corpus_into_the_bucket_is_idempotent(s3, bucket, docs, tiny_model_dir, tmp_path, store_home):
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(map(str, docs)) + "\n", encoding="utf-8")
    prefix = f"s3://{bucket}/corpus/"

    def statuses() -> list[str]:
        result = run("prefill", "--from-list", listing, "-o", prefix, "--model", tiny_model_dir, "--json")
        assert result.exit_code == 0, result.stderr
        return [r["status"] for r in json_lines(result.stdout)]

    assert statuses() == ["built", "built"]
    assert statuses() == ["skipped", "skipped"]
    s3.rm(f"{bucket}/corpus/doc1.kv/layer_000.safetensors.zst")  # an incomplete cache is rebuilt
    assert statuses() == ["skipped", "built"]
    doc_url = f"s3://{bucket}/docs/doc0.txt"  # documents can be URLs too
    s3.pipe_file(doc_url, docs[0].read_bytes())
    result = run("prefill", doc_url, "-o", f"s3://{bucket}/from-url/", "--model", tiny_model_dir, "--json")
    assert [r["status"] for r in json_lines(result.stdout)] == ["built"], result.stderr
    assert answer_ids(f"s3://{bucket}/from-url/doc0.kv") == answer_ids(f"{prefix}doc0.kv")


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    """A plain HTTP server on 127.0.0.1 serving a folder (the https:// read path without TLS)."""
    root = tmp_path_factory.mktemp("http")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_caches_are_read_only(http_root, docs, tiny_model_dir, store_home):
    pytest.importorskip("aiohttp", reason="fsspec's http:// needs aiohttp (pip install -e '.[remote]')")
    root, base = http_root
    local = root / "doc0.kv"
    assert run("prefill", docs[0], "-o", local, "--model", tiny_model_dir).exit_code == 0
    assert answer_ids(f"{base}/doc0.kv") == answer_ids(str(local))
    assert_clean_error(run("prefill", docs[0], "-o", f"{base}/new.kv", "--model", tiny_model_dir), 2, "read-only")
    assert_clean_error(run("prefill", docs[0], "-o", "hf://datasets/me/caches/", "--model", tiny_model_dir), 2, "hf:// is read-only")
    secret = run("info", base.replace("http://", "http://user:s3cret@") + "/missing.kv")
    assert_clean_error(secret, 3, "no manifest.json")
    assert "s3cret" not in secret.stderr


def test_local_store_is_bounded_and_cleared(docs, tiny_lm, tmp_path, store_home, monkeypatch):
    import fsspec

    import kvcli
    from kvcli.remote import objects

    mem = fsspec.filesystem("memory")
    urls = []
    for i, doc in enumerate(docs):
        kvcli.prefill(tiny_lm, kvcli.read_document(doc), tmp_path / f"c{i}.kv")
        url = f"memory://store-test-{uuid.uuid4().hex[:6]}/c{i}.kv"
        objects.upload(tmp_path / f"c{i}.kv", url, force=False)
        urls.append(url)
    first = local_store.fetch(urls[0])
    size = max(sum(f.stat().st_size for f in (tmp_path / f"c{i}.kv").iterdir()) for i in range(2))
    monkeypatch.setenv(local_store.MAX_VARIABLE, str(size + 10))  # room for either, not for both
    os.utime(first, (time.time() - 60, time.time() - 60))
    second = local_store.fetch(urls[1])  # over the bound: the least recently used copy goes
    assert [p for p, _, _ in local_store.entries()] == [second] and not first.exists()
    assert local_store.fetch(urls[1]) == second
    monkeypatch.setenv(local_store.MAX_VARIABLE, "lots")
    with pytest.raises(UsageError, match=local_store.MAX_VARIABLE):
        local_store.max_bytes()
    assert local_store.clear() > 0 and local_store.entries() == []
    mem.rm(urls[0].split("://")[1].split("/")[0], recursive=True)


class CountingProxy:
    """A TCP relay on 127.0.0.1 in front of moto that counts the bytes the server sends (what a client fetched)."""

    def __init__(self, port: int):
        self.upstream, self.received, self.lock = port, 0, threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream), timeout=30)
            self.open += [conn, up]
            threading.Thread(target=self._pump, args=(conn, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(65536):
                if count:
                    with self.lock:
                        self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        for s in self.open:
            s.close()


@pytest.fixture
def counted(s3, monkeypatch):
    """The s3:// clients of this process talk to moto through a CountingProxy."""
    import s3fs

    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    proxy = CountingProxy(port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    s3fs.S3FileSystem.clear_instance_cache()
    yield proxy
    proxy.close()
    s3fs.S3FileSystem.clear_instance_cache()


def _big_cache(s3, bucket, tiny_model_dir, tmp_path) -> tuple[str, int, int]:
    """A cache in the bucket whose shards outweigh its manifest many times: (url, manifest bytes, shard bytes)."""
    from kvcli.remote import objects

    doc = tmp_path / "long.txt"
    doc.write_text(sample_text()[:6000], encoding="utf-8")
    url = f"s3://{bucket}/big/long.kv"
    assert run("prefill", doc, "-o", url, "--model", tiny_model_dir).exit_code == 0
    raw = s3.cat_file(f"{bucket}/big/long.kv/manifest.json")
    m = objects.read_manifest(url)
    assert m.bytes_stored > 10 * len(raw)
    return url, len(raw), m.bytes_stored


def test_remote_cache_of_another_model_is_refused_on_its_manifest_alone(s3, bucket, tiny_model_dir, tokenizer, tmp_path,
                                                                          store_home, counted):
    from tests.conftest import tiny_llama

    url, manifest_size, shard_size = _big_cache(s3, bucket, tiny_model_dir, tmp_path)
    other = tmp_path / "other-model"
    tiny_llama(len(tokenizer), seed=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    counted.received = 0
    refused = run("ask", "--cache", url, QUESTION, "--model", other)
    assert_clean_error(refused, 3, url, "built for another model", "weights")
    assert counted.received < manifest_size + 16_000 < shard_size, (counted.received, manifest_size, shard_size)
    assert not local_store.entries()  # nothing stored
    counted.received = 0
    assert run("ask", "--cache", url, QUESTION, "--max-new-tokens", "2").exit_code == 0  # its own model: fetched whole
    assert counted.received >= shard_size


def test_manifest_claiming_more_than_the_store_bound_is_refused_before_any_shard(s3, bucket, tiny_model_dir, tmp_path,
                                                                                  store_home, counted, monkeypatch):
    url, manifest_size, shard_size = _big_cache(s3, bucket, tiny_model_dir, tmp_path)
    monkeypatch.setenv(local_store.MAX_VARIABLE, str(shard_size // 2))
    counted.received = 0
    refused = run("ask", "--cache", url, QUESTION)
    assert_clean_error(refused, 1, "more than the local store's bound", local_store.MAX_VARIABLE, "nothing was downloaded")
    assert counted.received < manifest_size + 16_000 < shard_size, (counted.received, manifest_size, shard_size)
    assert not local_store.entries()


def test_shard_longer_than_its_manifest_is_never_read_past_it(s3, bucket, tiny_model_dir, tmp_path, store_home, counted):
    url, manifest_size, shard_size = _big_cache(s3, bucket, tiny_model_dir, tmp_path)
    key = f"{bucket}/big/long.kv/layer_000.safetensors.zst"
    s3.pipe_file(key, s3.cat_file(key) + b"\0" * (8 << 20))  # 8 MiB appended in the bucket
    counted.received = 0
    assert_clean_error(run("ask", "--cache", url, QUESTION), 3, "layer_000.safetensors.zst", "manifest says")
    assert counted.received < shard_size + manifest_size + 64_000, counted.received  # not the 8 MiB
    assert not local_store.entries()


def test_plain_commands_never_import_fsspec(tmp_path, docs, tiny_model_dir):
    cache = tmp_path / "c.kv"
    assert run("prefill", docs[0], "-o", cache, "--model", tiny_model_dir).exit_code == 0
    code = f"""
import sys
from typer.testing import CliRunner
from kvcli.cli import app
for args in (["--help"], ["info", {str(cache)!r}], ["ls", {str(tmp_path)!r}], ["verify", {str(cache)!r}]):
    assert CliRunner().invoke(app, args).exit_code == 0, args
print(sorted(m for m in ("fsspec", "s3fs", "botocore", "torch", "transformers") if m in sys.modules))
"""
    result = run_python(code, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
