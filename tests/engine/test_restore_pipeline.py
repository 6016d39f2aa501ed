"""The restore pipeline onto a device (engine/cache/restore.py, transfer.py), on the CPU through a fake device link
whose copies run late on a thread of their own, as a copy stream does: layers arrive bit-identical to the CPU
restore, a staging buffer is never rewritten under a copy still reading it, each layer's compute waits for its
own copy only, and the question's first layers run while later layers are still copied. On a CUDA machine the
same checks run on the real copy stream."""

from __future__ import annotations

import threading

import pytest
import torch

from kvcli.documents import decode
from kvcli.engine.cache import restore, transfer
from kvcli.engine.cache.kvcache import FullLayer
from kvcli.engine.prefilling import prefill
from kvcli.errors import CacheCorruptError
from kvcli.format import store
from tests.conftest import sample_text
from tests.fake_link import FakeLink, same_layers


@pytest.fixture
def doc():
    return decode(sample_text()[:1500].encode(), "doc.txt")


@pytest.fixture
def cache_path(tiny_lm, doc, tmp_path):
    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path, chunk_size=64)
    return path


@pytest.mark.parametrize("staging", [1, 2, 8])
def test_layers_arrive_bit_identical_and_no_staging_buffer_is_reused_early(cache_path, monkeypatch, staging):
    """Copies run late (each after a pause), with as few as one staging buffer: a buffer rewritten before its copy
    read it would put another layer's bytes in place, which the bitwise comparison would catch."""
    made = []
    real = transfer.Staging

    def staging_of(nbytes, count, pinned, sync):
        made.append(real(nbytes, staging, pinned, sync))
        return made[-1]

    monkeypatch.setattr(transfer, "Staging", staging_of)
    link = FakeLink(delay=0.002)
    try:
        with store.open_cache(cache_path) as opened:
            want = restore.load_cache(opened).states()
            got = restore.load_cache(opened, link=link, threads=3)
        assert made and made[0].count == staging
        assert same_layers(got.states(), want)
        stats = got.restore_stats
        assert stats.layers == len(want) and stats.bytes_raw == sum(
            s.keys.numel() * s.keys.element_size() + s.values.numel() * s.values.element_size() for s in want)
        assert stats.read_s > 0 and stats.hash_s > 0 and stats.decode_s > 0
    finally:
        link.close()


def test_each_layer_waits_for_its_own_copy_only(cache_path):
    """load_cache returns with copies still queued; a layer's first reader waits for that layer's event, once, and
    reading layer 0 does not wait for the last layer's copy."""
    # One decoding thread queues the copies in layer order (two may queue the last layer first), and copies slow
    # enough that a busy machine's scheduling cannot finish the last one before layer 0 is read.
    link = FakeLink(delay=0.25)
    try:
        with store.open_cache(cache_path) as opened:
            kv = restore.load_cache(opened, link=link, threads=1)
        layers = kv.layers
        assert len(layers) >= 2
        assert all(layer._arrival is not None for layer in layers)
        layers[0].arrive()
        with link._lock:
            log = list(link.log)
        last_copy_done = [e[1] for e in log if e[0] == "queued"][-1]
        assert sum(1 for e in log if e[0] == "waited") == 1
        assert ("copied", last_copy_done) not in log  # layer 0 was read before the last layer had arrived
        assert layers[0]._arrival is None and layers[-1]._arrival is not None
        kv.arrive()  # every layer: all copies done
        assert all(layer._arrival is None for layer in layers)
        assert sum(1 for e in link.log if e[0] == "waited") == len(layers)
        assert ("copied", last_copy_done) in link.log
    finally:
        link.close()


def test_a_question_reads_each_layer_after_its_copy(tiny_lm, cache_path):
    """The model's forward pass over a question: every layer's update (where attention gets the document's
    keys/values) comes after that layer's copy, and the logits equal those on the CPU restore."""
    link = FakeLink(delay=0.005)
    order = []
    try:
        with store.open_cache(cache_path) as opened:
            ref = restore.load_cache(opened)
            kv = restore.load_cache(opened, link=link)
        for i, layer in enumerate(kv.layers):
            wait = layer._arrival

            def logged(wait=wait, i=i):
                wait()
                order.append(("arrived", i))

            layer.arriving(logged)
            update = layer.update

            def logged_update(*a, update=update, i=i, **k):
                order.append(("update", i))
                return update(*a, **k)

            layer.update = logged_update
        ids = torch.tensor([tiny_lm.tokenizer.encode(" What is licensed?")])
        n = ref.get_seq_length()
        with torch.inference_mode():
            mask = torch.ones((1, n + ids.shape[1]), dtype=torch.long)
            want = tiny_lm.model(input_ids=ids, attention_mask=mask, cache=ref, use_cache=True).logits
            got = tiny_lm.model(input_ids=ids, attention_mask=mask, cache=kv, use_cache=True).logits
        assert torch.equal(want, got)
        # layer i's keys/values are handed to attention (update returns them) only after layer i arrived, and
        # layer i waited for nothing but its own copy: arrivals interleave with the forward pass, layer by layer
        assert order == [e for i in range(len(kv.layers)) for e in (("update", i), ("arrived", i))]
    finally:
        link.close()


def test_a_damaged_shard_is_refused_before_any_copy_is_read(cache_path):
    m = store.read_manifest(cache_path)
    shard = cache_path / m.layers[1].file
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    link = FakeLink()
    try:
        with store.open_cache(cache_path) as opened, pytest.raises(CacheCorruptError, match=m.layers[1].file):
            restore.load_cache(opened, link=link, threads=2)
    finally:
        link.close()


def test_another_dtype_on_the_device(cache_path):
    link = FakeLink()
    try:
        with store.open_cache(cache_path) as opened:
            want = restore.load_cache(opened, dtype=torch.bfloat16).states()
            got = restore.load_cache(opened, dtype=torch.bfloat16, link=link).states()
        assert same_layers(got, want) and got[0].keys.dtype == torch.bfloat16
    finally:
        link.close()


def test_staging_waits_for_the_copy_that_read_a_buffer():
    done = threading.Event()
    synced = []
    staging = transfer.Staging(16, 1, False, lambda event: (event.wait(), synced.append(event)))
    buf = staging.take()
    staging.give(buf, done)
    threading.Timer(0.05, done.set).start()
    again = staging.take()  # blocks until the copy's event completed
    assert again is buf and synced == [done] and done.is_set()


def test_a_layer_restored_on_the_cpu_has_nothing_to_wait_for(cache_path):
    with store.open_cache(cache_path) as opened:
        kv = restore.load_cache(opened)
    assert all(layer._arrival is None for layer in kv.layers)
    assert kv.restore_stats.rates()["restore_gb_s_raw"] > 0
    assert isinstance(kv.layers[0], FullLayer)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


@cuda
def test_cuda_restore_equals_the_cpu_restore(cache_path):
    with store.open_cache(cache_path) as opened:
        want = restore.load_cache(opened).states()
        kv = restore.load_cache(opened, device="cuda")
    assert kv.restore_stats.rates()["copy_gb_s_raw"] > 0
    got = kv.states()
    torch.cuda.synchronize()
    assert all(s.keys.device.type == "cuda" for s in got)
    assert same_layers([type(s)(s.kind, s.keys.cpu(), s.values.cpu(), s.seq_length, s.sliding_window) for s in got], want)


def test_the_fast_setting_stores_plain_bytes_and_restores_the_same_layers(tiny_lm, doc, tmp_path):
    from kvcli.errors import UsageError
    from kvcli.format import codec

    small, fast = tmp_path / "small.kv", tmp_path / "fast.kv"
    prefill(tiny_lm, doc, small, chunk_size=64)
    prefill(tiny_lm, doc, fast, chunk_size=64, compression="fast")
    ms, mf_ = store.read_manifest(small), store.read_manifest(fast)
    assert codec.compression_name(ms.transform, ms.compression["level"]) == "small"
    assert (mf_.transform, mf_.compression["level"]) == codec.COMPRESSION["fast"] == ("none", -1)
    store.verify(fast)
    with store.open_cache(small) as a, store.open_cache(fast) as b:
        assert same_layers(restore.load_cache(b).states(), restore.load_cache(a).states())
    with pytest.raises(UsageError, match="--compression tiny: choose small or fast"):
        prefill(tiny_lm, doc, tmp_path / "x.kv", compression="tiny")


def test_device_auto_picks_the_gpu_when_there_is_one(monkeypatch):
    from kvcli.engine.model import models

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.pick_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert models.pick_device("auto") == "cpu"


@cuda
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "gpt2"])
def test_every_family_in_float32_on_cuda_answers_as_generate(tokenizer, plain_tokenizer, tmp_path, name):
    """test_architectures' exactness on the GPU: each family's tiny float32 model on CUDA, its cache restored
    through the copy stream, several questions on one Session, each answer equal to generate() on the GPU."""
    import kvcli
    from tests.architectures import ARCHS, DOC_CHARS, OPTS, QUESTIONS, build

    tok = plain_tokenizer if ARCHS[name][1] else tokenizer
    model = build(name, tok).to("cuda")
    lm = kvcli.from_objects(model, tok, name=f"tiny-{name}")
    path = tmp_path / "doc.kv"
    prefill(lm, decode(sample_text()[:DOC_CHARS].encode(), "licence.txt"), path, chunk_size=56)
    session = kvcli.Session(lm, path)
    assert session.cache.layers[0].keys.device.type == "cuda"
    for q in QUESTIONS:
        a = session.ask(q, OPTS)
        prompt = torch.tensor([a.prompt_token_ids], device="cuda")
        with torch.inference_mode():
            ref = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=OPTS.max_new_tokens)[0, prompt.shape[1]:].tolist()
        assert a.answer_token_ids == ref, q


def test_prefill_compression_fast_from_the_cli(tiny_model_dir, tmp_path):
    from tests.helpers import run

    doc = tmp_path / "doc.txt"
    doc.write_text(sample_text()[:600])
    result = run("prefill", doc, "--model", tiny_model_dir, "--compression", "fast", "--no-server", "-o", tmp_path / "fast.kv")
    assert result.exit_code == 0, result.stderr
    m = store.read_manifest(tmp_path / "fast.kv")
    assert (m.transform, m.compression["level"]) == ("none", -1)
    bad = run("prefill", doc, "--model", tiny_model_dir, "--compression", "tiny", "--no-server")
    assert bad.exit_code == 2 and "--compression" in bad.stderr and "Traceback" not in bad.stderr
