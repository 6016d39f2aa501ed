"""Memory a document's cache takes while it answers: the room restored after the document fits a question and a
default-length answer (the buffer keeps its size), growth comes in fixed steps (never a fraction of the whole
cache), and the warm server's account is the bytes actually held, measured as buffers grow, so --max-memory
holds while questions run."""

from __future__ import annotations

import pytest
import torch

import kvcli
from kvcli.documents import decode
from kvcli.engine.cache import restore
from kvcli.engine.cache.kvcache import GROW_STEP, FullLayer
from kvcli.engine.decoding.request import DEFAULT_MAX_NEW_TOKENS
from kvcli.engine.prefilling import prefill
from kvcli.engine.scheduling.scheduler import engine_for
from kvcli.requests import ModelSpec, SessionSpec
from kvcli.serve.warm import Warm
from tests.conftest import sample_text

Q = "Who is the licensor, and what does the license grant to everyone who receives the work?"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    """A tiny model of its own (its engine is set per test) that never ends an answer early, and two caches."""
    folder = tmp_path_factory.mktemp("memory")
    lm = kvcli.load(str(tiny_model_dir))
    lm.model.generation_config.eos_token_id = None  # every answer runs to max_new_tokens
    for name, text in (("a.kv", sample_text()[:2000]), ("b.kv", sample_text()[2000:3000])):
        prefill(lm, decode(text.encode(), name), folder / name)
    return lm, folder


def test_growth_is_in_fixed_steps_never_a_fraction_of_the_cache():
    layer = FullLayer()
    doc = torch.zeros(1, 1, 20_000, 2)
    layer.allocate(tuple(doc.shape), tuple(doc.shape), torch.float32, "cpu", room=10)
    layer.update(torch.zeros(1, 1, 11, 2), torch.zeros(1, 1, 11, 2))  # one token past the room
    assert layer.capacity == 20_480  # 20,010 + one step, rounded up to whole steps
    assert layer.capacity - 20_010 < 2 * GROW_STEP  # 0.2 grew it by a quarter of itself: to 25,088
    before = layer.capacity
    layer.ensure(1000)
    assert layer.capacity == -(-(layer.offset + 1000) // GROW_STEP) * GROW_STEP and layer.capacity - before < 1000 + GROW_STEP


def test_the_restored_room_fits_a_question_and_a_default_answer():
    assert restore.ROOM_TOKENS >= DEFAULT_MAX_NEW_TOKENS + GROW_STEP


def test_a_256_token_answer_leaves_the_restored_buffer_unchanged(tiny, monkeypatch):
    lm, folder = tiny
    monkeypatch.setattr(engine_for(lm), "batched", False)  # rows on the Session's own cache (the path that grows it)
    session = kvcli.Session(lm, folder / "a.kv")
    first = session.cache.layers[0]
    buffer, capacity, held = first._k, first.capacity, session.nbytes()
    a = session.ask(Q, kvcli.GenerationOptions(max_new_tokens=DEFAULT_MAX_NEW_TOKENS))
    assert len(a.answer_token_ids) == DEFAULT_MAX_NEW_TOKENS and a.finish_reason == "length"
    assert first._k is buffer and first.capacity == capacity and session.nbytes() == held
    # a longer answer: one growth, to what the question and its answer need, in whole steps
    b = session.ask(Q, kvcli.GenerationOptions(max_new_tokens=700))
    need = len(b.prompt_token_ids) + 700
    assert len(b.answer_token_ids) == 700 and first.capacity == -(-need // GROW_STEP) * GROW_STEP
    assert session.nbytes() > held


def test_max_memory_holds_while_questions_run(tiny, monkeypatch):
    lm, folder = tiny
    spec = str(lm.source.get("path") or lm.source.get("name"))
    warm = Warm(1 << 40)
    for name in ("a.kv", "b.kv"):
        with warm.session(SessionSpec((str(folder / name),), ModelSpec(spec))):
            pass
    s = warm.status()
    held = {c["path"].rsplit("/", 1)[1]: c["bytes"] for c in s["caches"]}
    model_bytes = s["models"][0]["bytes"]
    assert s["bytes"] == model_bytes + held["a.kv"] + held["b.kv"]
    warm.max_memory = s["bytes"] + 1000  # both caches fit while idle; not with an answering batch's buffers too
    seen: list[dict] = []
    with warm.session(SessionSpec((str(folder / "a.kv"),), ModelSpec(spec))) as lease:
        monkeypatch.setattr(engine_for(lease.session.lm), "batched", True)  # rows of a batch: suffix buffers
        lease.submit([f"{Q} ({i})" for i in range(4)], kvcli.GenerationOptions(max_new_tokens=120)).result(
            on_answer=lambda i, a: seen.append(warm.status()))
    during = seen[0]
    a_during = next(c["bytes"] for c in during["caches"] if c["path"].endswith("a.kv"))
    assert a_during > held["a.kv"]  # the batch's suffix buffers are counted while they are held
    assert [c["path"].rsplit("/", 1)[1] for c in during["caches"]] == ["a.kv"]  # b went to make room
    after = warm.status()
    assert after["bytes"] <= warm.max_memory and after["bytes"] == model_bytes + held["a.kv"]  # the suffixes went with the batch
