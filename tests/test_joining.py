"""Questions from many threads in one running batch (engine/joining.py, what the warm servers use).

Each asker gets the answer it would get asking alone; questions arriving together decode together, a
question arriving mid-answer joins between steps, an asker that leaves takes its rows out, and a
failing step reaches every asker in it without stopping the batcher.
"""

from __future__ import annotations

import threading
import time

import pytest

import kvcli
from kvcli.engine.joining import Batcher, Left
from kvcli.errors import GenerationError
from tests.test_architectures import arch  # noqa: F401  (the module's tiny-model fixture)

QUESTIONS = ("What does the word Licensor mean?", "Who?", "Is the Work provided with any warranty?",
             "When does the patent license terminate?", "What must a redistribution include?")
OPTS = kvcli.GenerationOptions(max_new_tokens=12)


def _wait(condition, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _in_threads(batcher: Batcher, questions, opts=OPTS, **kw) -> dict[int, object]:
    results: dict[int, object] = {}

    def one(i: int, q: str) -> None:
        try:
            results[i] = batcher.ask_many([q], opts, **kw)[0]
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
    turn = threading.Lock()
    batcher = Batcher(session, width=8, turn=lambda: turn)
    with turn:  # no step runs until every asker has submitted
        results, threads = _in_threads(batcher, QUESTIONS)
        _wait(lambda: batcher.asked == len(QUESTIONS))
    for t in threads:
        t.join(timeout=120)
    for i, s in enumerate(alone):
        got = results[i]
        assert got.answer_token_ids == s.answer_token_ids and got.answer == s.answer, (name, s.question)
        assert got.finish_reason == s.finish_reason and got.processed_tokens == s.processed_tokens
    assert batcher.peak_rows == len(QUESTIONS)  # all five decoded in one step
    _wait(lambda: not batcher.running)  # the decoding thread ends when nothing is left


def test_a_question_joins_while_another_decodes(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    long_opts, short_opts = kvcli.GenerationOptions(max_new_tokens=40), kvcli.GenerationOptions(max_new_tokens=6, seed=3, temperature=0.8)
    alone_long, alone_short = session.ask(QUESTIONS[0], long_opts), session.ask(QUESTIONS[2], short_opts)
    assert len(alone_long.answer_token_ids) > 5 and len(alone_short.answer_token_ids) > 2
    go, steps = threading.Event(), {"n": 0}

    class Turn:  # the third step waits until the second question has been asked
        def __enter__(self):
            steps["n"] += 1
            if steps["n"] == 3:
                assert go.wait(60)

        def __exit__(self, *exc):
            pass

    batcher = Batcher(session, width=4, turn=Turn)
    texts: list[str] = []
    results: dict[str, object] = {}

    def long_one() -> None:
        results["long"] = batcher.ask_many([QUESTIONS[0]], long_opts, on_text=lambda i, t: texts.append(t))[0]

    def short_one() -> None:
        results["short"] = batcher.ask_many([QUESTIONS[2]], short_opts)[0]

    threads = [threading.Thread(target=long_one)]
    threads[0].start()
    _wait(lambda: steps["n"] == 3)  # the long answer is under way
    threads.append(threading.Thread(target=short_one))
    threads[1].start()
    _wait(lambda: batcher.asked == 2)
    go.set()
    for t in threads:
        t.join(timeout=120)
    assert results["long"].answer_token_ids == alone_long.answer_token_ids and "".join(texts) == alone_long.answer
    assert results["short"].answer_token_ids == alone_short.answer_token_ids and results["short"].answer == alone_short.answer
    assert batcher.peak_rows == 2


def test_one_asker_many_questions_in_order_and_bounded(arch):
    a = arch("mistral")  # sliding windows
    session = kvcli.Session(a.lm, a.path)
    alone = [session.ask(q, OPTS) for q in QUESTIONS]
    turn = threading.Lock()
    batcher = Batcher(session, width=8, turn=lambda: turn)
    finished: list[int] = []
    results: dict[str, list] = {}

    def ask() -> None:
        results["got"] = batcher.ask_many(QUESTIONS, OPTS, batch_size=2, on_answer=lambda i, _a: finished.append(i))

    with turn:  # the first step waits until both of the asker's first questions are in
        t = threading.Thread(target=ask)
        t.start()
        _wait(lambda: batcher.asked == 2)
    t.join(timeout=120)
    got = results["got"]
    assert [g.answer_token_ids for g in got] == [s.answer_token_ids for s in alone]
    assert sorted(finished) == list(range(len(QUESTIONS)))
    assert batcher.peak_rows == 2  # batch_size bounds this asker's rows


def test_an_asker_that_leaves_takes_its_rows_out(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    batcher = Batcher(session, width=4)
    seen: list[str] = []
    with pytest.raises(Left):
        batcher.ask_many([QUESTIONS[0]], kvcli.GenerationOptions(max_new_tokens=500), on_text=lambda i, t: seen.append(t),
                         cancelled=lambda: bool(seen))
    _wait(lambda: not batcher.running)  # its row left: nothing more to decode
    assert batcher.steps < 500
    again = batcher.ask_many([QUESTIONS[1]], OPTS)[0]
    assert again.answer_token_ids == session.ask(QUESTIONS[1], OPTS).answer_token_ids


def test_a_callback_that_raises_leaves_too(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    batcher = Batcher(session, width=4)

    def broken(i, t):
        raise BrokenPipeError()

    with pytest.raises(BrokenPipeError):
        batcher.ask_many([QUESTIONS[0]], kvcli.GenerationOptions(max_new_tokens=500), on_text=broken)
    _wait(lambda: not batcher.running)
    assert batcher.steps < 500


def test_a_failing_step_reaches_every_asker_and_the_batcher_goes_on(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    calls = {"n": 0}
    lock = threading.Lock()

    class Turn:  # the third step fails, as a forward pass that runs out of memory would
        def __enter__(self):
            lock.acquire()
            calls["n"] += 1
            if calls["n"] == 3:
                lock.release()
                raise MemoryError("no room for this step")

        def __exit__(self, *exc):
            lock.release()

    batcher = Batcher(session, width=4, turn=Turn)
    with lock:
        results, threads = _in_threads(batcher, QUESTIONS[:3])
        _wait(lambda: batcher.asked == 3)
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and all(isinstance(r, (MemoryError, kvcli.Answer)) for r in results.values()), results
    assert any(isinstance(r, MemoryError) for r in results.values())  # every row still decoding got the step's error
    after = batcher.ask_many([QUESTIONS[1]], OPTS)[0]
    assert after.answer_token_ids == session.ask(QUESTIONS[1], OPTS).answer_token_ids


def test_a_question_too_long_fails_in_the_asker(arch):
    a = arch("phi3")  # 4,096 positions
    session = kvcli.Session(a.lm, a.path)
    batcher = Batcher(session, width=4)
    with pytest.raises(GenerationError, match="question too long"):
        batcher.ask_many(["word " * 5000], OPTS)
    assert not batcher.running
