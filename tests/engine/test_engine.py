"""The model's engine (engine/scheduling/scheduler.py): every question from every thread, stepped by one loop.

Each asker gets the answer it would get asking alone; questions arriving together decode together, a
question arriving mid-answer joins between steps, an asker that leaves takes its rows out at the next
step, a failing step reaches every asker in it without stopping the engine, a prefill on the same model
takes turns chunk by chunk with running answers, and closing the engine ends every waiting asker.
"""

from __future__ import annotations

import threading

import pytest

import kvcli
from kvcli.engine.decoding import batch, solo
from kvcli.engine.scheduling.scheduler import Cancelled, Engine, EngineClosed
from kvcli.errors import GenerationError
from tests.helpers import wait_until

QUESTIONS = ("What does the word Licensor mean?", "Who?", "Is the Work provided with any warranty?",
             "When does the patent license terminate?", "What must a redistribution include?")
OPTS = kvcli.GenerationOptions(max_new_tokens=12)


def _in_threads(engine: Engine, session, questions, opts=OPTS, **kw) -> dict[int, object]:
    results: dict[int, object] = {}

    def one(i: int, q: str) -> None:
        try:
            results[i] = engine.ask(session, [q], opts, **kw)[0]
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i, q)) for i, q in enumerate(questions)]
    for t in threads:
        t.start()
    return results, threads


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # full attention; sliding windows with softcapping
def test_questions_arriving_together_decode_together(arch, name):
    a = arch(name)
    session = kvcli.Session(a.lm, a.path)
    alone = [session.ask(q, OPTS) for q in QUESTIONS]
    assert min(len(s.answer_token_ids) for s in alone) >= 3  # so all five are still decoding at the third step
    engine = Engine(a.lm, width=8)
    with engine.turn():  # no step runs until every asker has submitted
        results, threads = _in_threads(engine, session, QUESTIONS)
        wait_until(lambda: engine.asked == len(QUESTIONS))
    for t in threads:
        t.join(timeout=120)
    for i, s in enumerate(alone):
        got = results[i]
        assert got.answer_token_ids == s.answer_token_ids and got.answer == s.answer, (name, s.question)
        assert got.finish_reason == s.finish_reason and got.processed_tokens == s.processed_tokens
    assert engine.peak_rows == len(QUESTIONS)  # all five decoded in one step
    wait_until(lambda: not engine.busy)


def test_a_question_joins_while_another_decodes(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    long_opts, short_opts = kvcli.GenerationOptions(max_new_tokens=40), kvcli.GenerationOptions(max_new_tokens=6, seed=3, temperature=0.8)
    alone_long, alone_short = session.ask(QUESTIONS[0], long_opts), session.ask(QUESTIONS[2], short_opts)
    assert len(alone_long.answer_token_ids) > 5 and len(alone_short.answer_token_ids) > 2
    go, steps = threading.Event(), {"n": 0}
    engine = Engine(a.lm, width=4)
    real_step = engine._step

    def step(session, decoder):  # the third step waits until the second question has been asked
        steps["n"] += 1
        if steps["n"] == 3:
            assert go.wait(60)
        steps[steps["n"]] = (decoder.batch is not None, len(decoder.rows))
        real_step(session, decoder)

    engine._step = step
    texts: list[str] = []
    results: dict[str, object] = {}

    def long_one() -> None:
        results["long"] = engine.ask(session, [QUESTIONS[0]], long_opts, on_text=lambda i, t: texts.append(t))[0]

    def short_one() -> None:
        results["short"] = engine.ask(session, [QUESTIONS[2]], short_opts)[0]

    threads = [threading.Thread(target=long_one)]
    threads[0].start()
    wait_until(lambda: steps["n"] == 3)  # the long answer is under way
    threads.append(threading.Thread(target=short_one))
    threads[1].start()
    wait_until(lambda: engine.asked == 2)
    go.set()
    for t in threads:
        t.join(timeout=120)
    assert results["long"].answer_token_ids == alone_long.answer_token_ids and "".join(texts) == alone_long.answer
    assert results["short"].answer_token_ids == alone_short.answer_token_ids and results["short"].answer == alone_short.answer
    assert engine.peak_rows == 2
    # alone, the long row ran on the document's own cache (engine/decoding/lone.py); joined, both went on batched
    assert steps[3] == (False, 1) and steps[4] == (False, 2) and steps[5] == (True, 2), steps


def test_one_asker_many_questions_in_order_and_bounded(arch):
    a = arch("mistral")  # sliding windows
    session = kvcli.Session(a.lm, a.path)
    alone = [session.ask(q, OPTS) for q in QUESTIONS]
    engine = Engine(a.lm, width=8)
    finished: list[int] = []
    results: dict[str, list] = {}

    def ask() -> None:
        results["got"] = engine.ask(session, QUESTIONS, OPTS, limit=2, on_answer=lambda i, _a: finished.append(i))

    with engine.turn():  # the first step waits until both of the asker's first questions are in
        t = threading.Thread(target=ask)
        t.start()
        wait_until(lambda: engine.asked == 2)
    t.join(timeout=120)
    got = results["got"]
    assert [g.answer_token_ids for g in got] == [s.answer_token_ids for s in alone]
    assert sorted(finished) == list(range(len(QUESTIONS)))
    assert engine.peak_rows == 2  # the limit bounds this asker's rows


def test_an_asker_that_leaves_takes_its_rows_out(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=4)
    request = engine.submit(session, [QUESTIONS[0]], kvcli.GenerationOptions(max_new_tokens=500))
    with pytest.raises(Cancelled):
        request.result(on_text=lambda i, t: request.cancel())
    left_at = engine.steps
    wait_until(lambda: not engine.busy)  # its row left: nothing more to decode
    assert engine.steps <= left_at + 1  # within one step of the asker leaving
    again = engine.ask(session, [QUESTIONS[1]], OPTS)[0]
    assert again.answer_token_ids == session.ask(QUESTIONS[1], OPTS).answer_token_ids


def test_a_callback_that_raises_leaves_too(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=4)

    def broken(i, t):
        raise BrokenPipeError()

    with pytest.raises(BrokenPipeError):
        engine.ask(session, [QUESTIONS[0]], kvcli.GenerationOptions(max_new_tokens=500), on_text=broken)
    left_at = engine.steps
    wait_until(lambda: not engine.busy)
    assert engine.steps <= left_at + 1


def test_a_failing_step_reaches_every_asker_and_the_engine_goes_on(arch, monkeypatch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    calls = {"n": 0}
    real_step = batch.BatchDecoder.step

    def step(self):  # the third step fails, as a forward pass that runs out of memory would
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("no room for this step")
        return real_step(self)

    monkeypatch.setattr(batch.BatchDecoder, "step", step)
    engine = Engine(a.lm, width=4)
    with engine.turn():
        results, threads = _in_threads(engine, session, QUESTIONS[:3])
        wait_until(lambda: engine.asked == 3)
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and all(isinstance(r, (MemoryError, kvcli.Answer)) for r in results.values()), results
    assert any(isinstance(r, MemoryError) for r in results.values())  # every row still decoding got the step's error
    after = engine.ask(session, [QUESTIONS[1]], OPTS)[0]
    assert after.answer_token_ids == session.ask(QUESTIONS[1], OPTS).answer_token_ids


def test_a_failing_step_one_at_a_time_reaches_the_row_it_was_decoding(arch, monkeypatch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    calls = {"n": 0}
    real_step = solo.OneRowDecoder.step

    def step(self):  # the third step fails: the first row's second answer token, mid-answer
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("no room for this step")
        return real_step(self)

    monkeypatch.setattr(solo.OneRowDecoder, "step", step)
    engine = Engine(a.lm, width=4, batched=False)
    with engine.turn():
        results, threads = _in_threads(engine, session, QUESTIONS[:2])
        wait_until(lambda: engine.asked == 2)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)  # the row that was decoding heard the error too
    assert all(isinstance(r, MemoryError) for r in results.values()) and len(results) == 2, results
    after = engine.ask(session, [QUESTIONS[1]], OPTS)[0]  # the document's cache was rewound
    assert after.answer_token_ids == session.ask(QUESTIONS[1], OPTS).answer_token_ids


def test_a_question_too_long_fails_in_the_asker(arch):
    a = arch("phi3")  # 4,096 positions
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=4)
    with pytest.raises(GenerationError, match="question too long"):
        engine.ask(session, ["word " * 5000], OPTS)
    assert not engine.busy and engine.asked == 0


def test_a_prefill_takes_turns_with_a_running_answer(arch, tmp_path):
    """A prefill on the model pauses a streaming answer for one chunk at a time, never for the whole document."""
    from kvcli.documents import decode
    from kvcli.engine.cache.kvcache import KVCache
    from kvcli.engine.prefilling import prefill
    from kvcli.engine.scheduling.scheduler import engine_for
    from tests.conftest import sample_text

    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = engine_for(a.lm)  # the one prefill uses
    opts = kvcli.GenerationOptions(max_new_tokens=120)
    alone = session.ask(QUESTIONS[0], opts)
    timeline: list[str] = []
    real_step = engine._step

    def step(session, decoder):
        real_step(session, decoder)
        timeline.append("step")

    engine._step = step
    real_forward = a.lm.model.forward

    def forward(*args, **kwargs):
        if isinstance(kwargs.get("cache"), KVCache) and kwargs["input_ids"].shape[-1] == 16:  # a prefill chunk
            timeline.append("chunk")
        return real_forward(*args, **kwargs)

    a.lm.model.forward = forward
    got: dict[str, object] = {}
    try:
        t = threading.Thread(target=lambda: got.setdefault("a", session.ask(QUESTIONS[0], opts)))
        t.start()
        wait_until(lambda: timeline.count("step") >= 3)
        prefill(a.lm, decode(sample_text()[:800].encode(), "other.txt"), tmp_path / "other.kv", chunk_size=16)
        t.join(timeout=120)
    finally:
        del a.lm.model.forward
        del engine.__dict__["_step"]
    assert got["a"].answer_token_ids == alone.answer_token_ids
    chunks = [i for i, e in enumerate(timeline) if e == "chunk"]
    assert len(chunks) >= 5
    last_step = max(i for i, e in enumerate(timeline) if e == "step")
    # while the answer ran, every two prefill chunks had a decoding step between them
    running = [c for c in chunks if c < last_step]
    assert running and all(b - a > 1 for a, b in zip(running, running[1:])), timeline


def test_a_prefill_cuts_its_chunks_while_answers_decode(arch, tmp_path, monkeypatch):
    """While an answer decodes on the model, a prefill runs SHARED_SLICE tokens per turn, not whole chunks; idle,
    whole chunks; the cache it writes answers as an idle prefill's does."""
    from kvcli.documents import decode
    from kvcli.engine import prefilling
    from kvcli.engine.cache.kvcache import KVCache
    from kvcli.engine.scheduling.scheduler import engine_for
    from tests.conftest import sample_text

    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = engine_for(a.lm)
    monkeypatch.setattr(prefilling, "SHARED_SLICE", 8)
    doc = decode(sample_text()[:800].encode(), "other.txt")
    sizes: list[tuple[int, bool]] = []
    real_forward = a.lm.model.forward

    def forward(*args, **kwargs):
        if isinstance(kwargs.get("cache"), KVCache) and kwargs.get("logits_to_keep") == 1 and "attention_mask" not in kwargs:
            sizes.append((kwargs["input_ids"].shape[-1], engine.decoding))  # a prefill chunk
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(a.lm.model, "forward", forward)
    idle = prefilling.prefill(a.lm, doc, tmp_path / "idle.kv", chunk_size=32)
    assert {n for n, _ in sizes[:-1]} == {32}
    sizes.clear()
    opts = kvcli.GenerationOptions(max_new_tokens=200)
    t = threading.Thread(target=lambda: session.ask(QUESTIONS[0], opts))
    t.start()
    wait_until(lambda: engine.decoding)
    busy = prefilling.prefill(a.lm, doc, tmp_path / "busy.kv", chunk_size=32)
    t.join(timeout=120)
    assert busy.manifest.num_tokens == idle.manifest.num_tokens
    cut = [n for n, decoding in sizes if decoding]
    assert cut and set(cut[:-1]) <= {8}, sizes  # every turn taken while the answer ran was a slice (the last may be shorter)
    assert all(n == 32 for n, decoding in sizes[:-1] if not decoding)
    q = kvcli.GenerationOptions(max_new_tokens=12)
    assert (kvcli.Session(a.lm, tmp_path / "busy.kv").ask("Who?", q).answer_token_ids
            == kvcli.Session(a.lm, tmp_path / "idle.kv").ask("Who?", q).answer_token_ids)


def test_closing_the_engine_ends_every_asker(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=4)
    seen: list[str] = []
    results, threads = _in_threads(engine, session, QUESTIONS[:2], kvcli.GenerationOptions(max_new_tokens=500),
                                   on_text=lambda i, t: seen.append(t))
    wait_until(lambda: seen)
    engine.close()
    for t in threads:
        t.join(timeout=60)
    assert all(isinstance(r, EngineClosed) for r in results.values()), results
    assert not engine.busy
    with pytest.raises(EngineClosed):
        engine.ask(session, [QUESTIONS[0]], OPTS)


def test_turns_are_granted_in_arrival_order(arch):
    a = arch("llama")
    engine = Engine(a.lm, width=4)
    order: list[int] = []
    first = engine.turn()
    first.__enter__()

    def waiter(n):
        with engine.turn():
            order.append(n)

    threads = []
    for n in range(5):
        threads.append(threading.Thread(target=waiter, args=(n,)))
        threads[-1].start()
        wait_until(lambda: len(engine._turns) == n + 1, timeout=10)  # each is queued before the next starts
    first.__exit__(None, None, None)
    for t in threads:
        t.join(timeout=10)
    assert order == [0, 1, 2, 3, 4]
