"""kvcli's cache object (engine/cache/kvcache.py): full-attention layers append into a preallocated buffer,
grow in steps, crop and rewind without copying; the restored document's bytes are never written, by
questions that fit in the room, by questions that force growth, or after a crop; and Sessions asked
from several threads give the serial answers, exact per-call processed counts and seeded samples
that no other thread disturbs."""

from __future__ import annotations

import threading

import pytest
import torch

import kvcli
from kvcli.engine.scheduling.scheduler import engine_for
from kvcli.documents import decode
from kvcli.engine.cache import layers, restore
from kvcli.engine.cache.kvcache import FullLayer, KVCache, SlidingLayer
from kvcli.engine.prefilling import prefill
from tests.conftest import TokenCounter, reference_answer, sample_text

QUESTIONS = ("Who is the licensor?", "What does the license grant?", "Is there any warranty?", "What is a Contribution?")


def _kv(n: int, seed: int, heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, dim, generator=g), torch.randn(1, heads, n, dim, generator=g)


# ---------------------------------------------------------------- one full-attention layer, random tensors


def test_full_layer_appends_in_place_and_grows_in_steps():
    layer = FullLayer(reserve=10, step=16)
    k1, v1 = _kv(6, 0)
    keys, values = layer.update(k1, v1)
    buf = layer._k
    assert buf.shape[2] == 10 and keys.shape[2] == 6 and layer.get_seq_length() == 6
    k2, v2 = _kv(4, 1)
    keys, values = layer.update(k2, v2)  # exactly fills the reserve: same buffer
    assert layer._k is buf and keys.data_ptr() == buf.data_ptr()
    k3, v3 = _kv(3, 2)
    keys, values = layer.update(k3, v3)  # full: one bigger buffer, the used part copied once
    assert layer._k is not buf and layer._k.shape[2] % 16 == 0 and layer._k.shape[2] >= 13
    assert torch.equal(keys, torch.cat([k1, k2, k3], dim=2)) and torch.equal(values, torch.cat([v1, v2, v3], dim=2))
    assert layer.get_mask_sizes(1) == (14, 0)


def test_full_layer_crop_and_rewind_cost_no_copy():
    layer = FullLayer()
    doc_k, doc_v = _kv(20, 0)
    k, v = layer.allocate(tuple(doc_k.shape), tuple(doc_v.shape), torch.float32, "cpu", room=8)
    k.copy_(doc_k)
    v.copy_(doc_v)
    buf = layer._k
    layer.update(*_kv(5, 1))
    layer.rewind()
    assert layer.get_seq_length() == 20 and layer._k is buf and torch.equal(layer.keys, doc_k)
    layer.update(*_kv(5, 2))
    layer.crop(-3)
    assert layer.get_seq_length() == 22 and layer._k is buf
    with pytest.raises(ValueError):
        layer.crop(3)  # transformers' convention: a positive argument is refused
    layer.crop(-12)  # into the document: the document is now 10 tokens long
    layer.rewind()
    assert layer.get_seq_length() == 10 and torch.equal(layer.keys, doc_k[:, :, :10])


def test_cache_counts_tokens_through_layer_zero_and_copies_share_nothing():
    states = [layers.LayerState("full", *_kv(12, 0), 12, None), layers.LayerState("sliding", *_kv(7, 1), 30, 8)]
    cache = KVCache.from_states(states, room=4)
    assert cache.get_seq_length() == 12 and cache.layers[1].get_seq_length() == 30  # counted length, not 7
    assert isinstance(cache.layers[1], SlidingLayer)
    for i in range(2):
        cache.update(*_kv(3, 5), layer_idx=i)
    assert cache.processed == 3
    other = cache.copy()
    for a, b in zip(cache.layers, other.layers):
        ka, kb = a.document()[0], b.document()[0]
        assert torch.equal(ka, kb) and ka.untyped_storage().data_ptr() != kb.untyped_storage().data_ptr()
    cache.rewind()
    assert cache.processed == 0 and cache.get_seq_length() == 12 and cache.layers[1].get_seq_length() == 30
    for s, layer in zip(states, cache.layers):
        assert torch.equal(layer.keys, s.keys) and torch.equal(layer.values, s.values)


# ---------------------------------------------------------------- a restored document on a tiny model


@pytest.fixture(scope="module")
def doc_cache(tiny_lm, tmp_path_factory):
    path = tmp_path_factory.mktemp("kvcache") / "doc.kv"
    prefill(tiny_lm, decode(sample_text()[:1500].encode(), "doc.txt"), path)
    return path


def _snapshot(session):
    return [(s.keys.clone(), s.values.clone()) for s in session.states]


def _same_document(session, saved) -> bool:
    return all(torch.equal(s.keys, k) and torch.equal(s.values, v) for s, (k, v) in zip(session.states, saved))


def test_questions_that_force_growth_and_a_crop_never_change_the_documents_bytes(tiny_lm, doc_cache, monkeypatch):
    monkeypatch.setattr(restore, "ROOM_TOKENS", 24)  # questions (~15 tokens) plus 30 answer tokens overflow it
    # rows one at a time on the Session's own cache (what a model whose batched path is not proven exact gets)
    monkeypatch.setattr(engine_for(tiny_lm), "batched", False)
    session = kvcli.Session(tiny_lm, doc_cache)
    n = len(session.token_ids)
    first = session.cache.layers[0]
    buffer = first._k
    assert buffer.shape[2] == n + 24
    doc_keys = first.document()[0]  # a view of the original buffer, kept to check it is never written
    saved = _snapshot(session)
    opts = kvcli.GenerationOptions(max_new_tokens=30)
    for q in QUESTIONS[:2]:
        a = session.ask(q, opts)
        assert a.answer_token_ids == reference_answer(tiny_lm.model, a.prompt_token_ids, 30)
        assert a.processed_tokens == a.new_tokens + len(a.answer_token_ids) - 1
        assert _same_document(session, saved) and session.cache.get_seq_length() == n
    assert first._k is not buffer  # the answer grew the buffer (the document was copied along)
    assert torch.equal(doc_keys, saved[0][0])  # and the old buffer's document was never written either
    grown = first._k
    session.ask(QUESTIONS[2], opts)
    assert first._k is grown  # the grown buffer is kept for the next questions

    cache = session.cache
    shape = (1, session.states[0].keys.shape[1], 5, session.states[0].keys.shape[3])
    with torch.inference_mode():  # generate() grew the buffer in inference mode
        for i in range(len(cache.layers)):
            cache.update(torch.randn(shape), torch.randn(shape), layer_idx=i)
        cache.crop(-5)  # the tokens after the document are dropped: the document is untouched
        cache.rewind()
    assert _same_document(session, saved)
    a = session.ask(QUESTIONS[0], opts)
    assert a.answer_token_ids == reference_answer(tiny_lm.model, a.prompt_token_ids, 30)


def test_two_sessions_on_one_document_share_no_memory(tiny_lm, doc_cache):
    one, two = kvcli.Session(tiny_lm, doc_cache), kvcli.Session(tiny_lm, doc_cache)
    for a, b in zip(one.states, two.states):
        assert torch.equal(a.keys, b.keys)
        assert a.keys.untyped_storage().data_ptr() != b.keys.untyped_storage().data_ptr()


def test_threads_asking_one_session_match_serial_answers_and_counts(tiny_lm, doc_cache):
    session = kvcli.Session(tiny_lm, doc_cache)
    opts = kvcli.GenerationOptions(max_new_tokens=12)
    saved = _snapshot(session)
    serial = {q: session.ask(q, opts) for q in QUESTIONS}
    results: dict[tuple[int, str], object] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(t: int):
        try:
            barrier.wait(timeout=30)
            for q in QUESTIONS[t:] + QUESTIONS[:t]:  # every thread in another order
                results[(t, q)] = session.ask(q, opts)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == 4 * len(QUESTIONS)
    for (_t, q), a in results.items():
        want = serial[q]
        assert a.answer_token_ids == want.answer_token_ids and a.answer == want.answer
        assert a.processed_tokens == want.processed_tokens == a.new_tokens + len(a.answer_token_ids) - 1
    assert _same_document(session, saved) and session.cache.get_seq_length() == len(session.token_ids)
    assert session.stats["peak_rows"] >= 2  # concurrent questions shared forward passes (rows of the model's engine)


def test_seeded_sampling_is_reproducible_while_other_threads_sample(tiny_lm, doc_cache):
    session = kvcli.Session(tiny_lm, doc_cache)
    seeded = kvcli.GenerationOptions(max_new_tokens=12, temperature=1.5, top_p=0.95, seed=7)
    alone = session.ask(QUESTIONS[0], seeded)
    assert alone.answer_token_ids == session.ask(QUESTIONS[0], seeded).answer_token_ids
    other_seed = session.ask(QUESTIONS[0], kvcli.GenerationOptions(max_new_tokens=12, temperature=1.5, top_p=0.95, seed=8))
    assert other_seed.answer_token_ids != alone.answer_token_ids  # the seed does steer the draw
    greedy = session.ask(QUESTIONS[0], kvcli.GenerationOptions(max_new_tokens=12))
    assert greedy.answer_token_ids != alone.answer_token_ids  # and it did sample
    torch.manual_seed(0)
    global_state = torch.random.get_rng_state()
    got: list[list[int]] = []
    errors: list[BaseException] = []

    def noisy():  # unseeded samplers and global-RNG users run alongside
        try:
            for _ in range(3):
                session.ask(QUESTIONS[1], kvcli.GenerationOptions(max_new_tokens=12, temperature=1.0))
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    def seeded_worker():
        try:
            for _ in range(3):
                got.append(session.ask(QUESTIONS[0], seeded).answer_token_ids)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=noisy), threading.Thread(target=noisy), threading.Thread(target=seeded_worker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == [alone.answer_token_ids] * 3
    assert torch.equal(torch.random.get_rng_state(), global_state)  # nobody touched the global generator


def test_processed_tokens_match_a_forward_hook(tiny_lm, doc_cache):
    session = kvcli.Session(tiny_lm, doc_cache)
    counter = TokenCounter(tiny_lm.model)
    try:
        a = session.ask(QUESTIONS[0], kvcli.GenerationOptions(max_new_tokens=8))
    finally:
        counter.close()
    assert a.processed_tokens == counter.total and counter.calls[0] == a.new_tokens
