"""Concurrent readers: many `ask` processes on one cache all succeed with the same answer, and a prefill
replacing a cache while asks read it never makes an ask see a mix of old and new.

Readers open the cache directory once and every file relative to that handle, so they hold one
snapshot: the old cache or the new one. The races are exercised three ways: real `python -m kvcli`
processes (one real replacing prefill plus a fast replacer swapping caches every few milliseconds),
reader threads in this process, and deterministic interleavings forced at each step of opening.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcli.errors import CacheBusyError
from kvcli.format import manifest as mf
from kvcli.format import store, writing

QUESTION = "Who may use the work?"
MAX_NEW = 4
REPEATS = 15  # caches each swapping-ask process loads one after the other (the same path, -c repeated)
MIN_SWAPS, MAX_SWAPS = 40, 2000  # swaps of the cache under the reader threads (counted, never timed)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    import kvcli
    from kvcli.engine.prefilling import prefill
    from tests.conftest import sample_text

    root = tmp_path_factory.mktemp("concurrency")
    text = sample_text()
    docs = {"a": root / "a.txt", "b": root / "b.txt"}
    docs["a"].write_text(text[:1400], encoding="utf-8")
    docs["b"].write_text(text[1400:2600], encoding="utf-8")
    lm = kvcli.load(str(tiny_model_dir))
    refs = {k: root / f"ref-{k}.kv" for k in docs}
    for k in docs:
        prefill(lm, kvcli.read_document(docs[k]), refs[k])
    opts = kvcli.GenerationOptions(max_new_tokens=MAX_NEW)
    answers = {k: kvcli.Session(lm, refs[k]).ask(QUESTION, opts).answer for k in docs}
    assert answers["a"] != answers["b"]
    shas = {k: store.read_manifest(refs[k]).document["sha256"] for k in docs}
    return {"root": root, "docs": docs, "lm": lm, "refs": refs, "answers": answers, "shas": shas, "model": tiny_model_dir}


def install_copy(target: Path, source: Path) -> None:
    """Replace `target` by a copy of the cache `source` through the same atomic path prefill uses."""
    with writing.atomic_cache_dir(target, force=True) as tmp:
        names = sorted(os.listdir(source), key=lambda n: n == mf.MANIFEST_NAME)  # manifest last, as prefill does
        for name in names:
            shutil.copyfile(source / name, tmp / name)


def kvcli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "kvcli", *map(str, args)]


def test_concurrent_asks_agree_and_a_replacing_prefill_never_mixes(world, tmp_path):
    w = world
    stable, swapping = tmp_path / "stable.kv", tmp_path / "swapping.kv"
    shutil.copytree(w["refs"]["a"], stable)
    shutil.copytree(w["refs"]["a"], swapping)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    swaps, busy = [0], [0]
    stop = threading.Event()
    errors: list[str] = []

    def replacer():  # flips the cache between documents b and a while the asks read it
        k = "b"
        while not stop.is_set():
            try:
                install_copy(swapping, w["refs"][k])
            except CacheBusyError:  # the prefill holds the writer lock: a second writer waits its turn
                busy[0] += 1
                time.sleep(0.02)
                continue
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(repr(exc))
                return
            swaps[0] += 1
            k = "a" if k == "b" else "b"
            time.sleep(0.02)

    thread = threading.Thread(target=replacer, daemon=True)
    thread.start()
    try:
        same = [subprocess.Popen(kvcli_cmd("ask", "--model", w["model"], "-c", stable, QUESTION, "--max-new-tokens", MAX_NEW),
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        cache_args = [arg for _ in range(REPEATS) for arg in ("-c", swapping)]
        mixed = [subprocess.Popen(kvcli_cmd("ask", "--model", w["model"], *cache_args, QUESTION, "--max-new-tokens", MAX_NEW, "--json"),
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        # The prefill holds the writer lock from its start, so the replacer waits meanwhile: let the swapping asks
        # read their first caches under the replacer's swaps before it starts.
        firsts = [p.stdout.readline() for p in mixed]
        # The prefill is refused (exit 3) when it starts during one of the replacer's writes; it tries again, as a
        # script would, at most 20 times (each try collides with a few-millisecond copy in every 20 ms at worst).
        for _ in range(20):
            prefill = subprocess.run(kvcli_cmd("prefill", w["docs"]["b"], "-o", swapping, "--model", w["model"], "--force", "-q"),
                                     env=env, capture_output=True, text=True, timeout=300)
            if "is writing this cache now" not in prefill.stderr:
                break
        results = [(p, *p.communicate(timeout=300)) for p in same]
        for p, first in zip(mixed, firsts):  # their stdout has been read from: read on, not communicate(), which would lose what readline buffered
            out, err = first + p.stdout.read(), p.stderr.read()  # stderr is a few lines: it never fills its pipe
            p.wait(timeout=300)
            results.append((p, out, err))
        results.append((prefill, prefill.stdout, prefill.stderr))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    for p, out, err in results:
        assert p.returncode == 0, err
        assert "kvcli: error" not in err and "Traceback" not in err, err
    outs = [out for p, out, _ in results[: len(same)]]
    assert outs == [w["answers"]["a"] + "\n"] * len(same)
    seen = {"a": 0, "b": 0}
    for _p, out, _ in results[len(same) : len(same) + len(mixed)]:
        answers = [json.loads(line)["answer"] for line in out.splitlines() if line.strip()]
        assert len(answers) == REPEATS
        for a in answers:
            kind = [k for k, ref in w["answers"].items() if ref == a]
            assert kind, f"an answer from neither the old nor the new cache: {a!r}"
            seen[kind[0]] += 1
    assert swaps[0] > 10 and seen["a"] and seen["b"], (swaps[0], busy[0], seen)
    assert store.verify(swapping).document["sha256"] in w["shas"].values()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stable.kv", "swapping.kv"]  # no temporary folder left


def test_reader_threads_never_see_a_mix(world, tmp_path):
    """Thousands of reads (manifest + every shard's size and sha256) from threads while the cache is swapped."""
    w = world
    target = tmp_path / "doc.kv"
    shutil.copytree(w["refs"]["a"], target)
    kinds = {sha: k for k, sha in w["shas"].items()}
    counts, errors = {"a": 0, "b": 0}, []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                with store.open_cache(target) as cache:
                    kind = kinds[cache.manifest.document["sha256"]]
                    for i in range(len(cache.manifest.layers)):
                        cache.read_shard(i)  # a shard of the other cache fails its size or sha256 check
                counts[kind] += 1
            except Exception as exc:
                errors.append(f"{exc.__class__.__name__}: {exc}")
                return

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    swaps = 0  # bounded in count, not in time: at least MIN_SWAPS, then on until the readers saw both (or MAX_SWAPS)
    while not errors and swaps < MAX_SWAPS and (swaps < MIN_SWAPS or not (counts["a"] and counts["b"])):
        install_copy(target, w["refs"]["b" if swaps % 2 == 0 else "a"])
        swaps += 1
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors[:3]
    assert swaps >= MIN_SWAPS and counts["a"] > 0 and counts["b"] > 0, (swaps, counts)


@pytest.mark.parametrize("moment", ["before the manifest is opened", "after the manifest is read", "after every shard is opened"])
def test_replaced_at_each_step_of_opening(world, tmp_path, monkeypatch, moment):
    """Force the replacement (swap in, old one deleted) at one exact step of a reader's open."""
    from kvcli.engine.cache import restore

    w = world
    target = tmp_path / "doc.kv"
    shutil.copytree(w["refs"]["a"], target)
    fired = []

    def replace_once():
        if not fired:
            fired.append(True)
            install_copy(target, w["refs"]["b"])

    if moment == "before the manifest is opened":
        real_open_in = store._open_in

        def open_in(dir_fd, name, where):
            if name == mf.MANIFEST_NAME:
                replace_once()
            return real_open_in(dir_fd, name, where)

        monkeypatch.setattr(store, "_open_in", open_in)
    elif moment == "after the manifest is read":
        real_parse = mf.parse

        def parse(raw, where):
            result = real_parse(raw, where)
            replace_once()
            return result

        monkeypatch.setattr(mf, "parse", parse)
    cache = store.open_cache(target)
    if moment == "after every shard is opened":
        replace_once()
    try:
        assert fired
        expect = "a" if moment == "after every shard is opened" else "b"  # an open in progress starts over
        assert cache.manifest.document["sha256"] == w["shas"][expect]
        for i in range(len(cache.manifest.layers)):
            cache.read_shard(i)
        states = restore.load_states(cache)
    finally:
        cache.close()
    with store.open_cache(w["refs"][expect]) as ref:
        ref_states = restore.load_states(ref)
    for got, want in zip(states, ref_states):
        assert got.keys.equal(want.keys) and got.values.equal(want.values)
    assert store.verify(target).document["sha256"] == w["shas"]["b"]
