"""The request object (engine/scheduling/scheduler.py Request, events in engine/scheduling/requests.py): one
submission read as typed events, ended early by cancel() or by the engine closing, with one exception each."""

from __future__ import annotations

import threading

import pytest

import kvcli
from kvcli.engine.scheduling.requests import Answered, Cancelled, Done, EngineClosed, Failed, Text
from kvcli.engine.scheduling.scheduler import Engine
from tests.helpers import wait_until

QUESTIONS = ("What does the word Licensor mean?", "Who?", "Is the Work provided with any warranty?")
OPTS = kvcli.GenerationOptions(max_new_tokens=10)
LONG = kvcli.GenerationOptions(max_new_tokens=500)


def test_events_come_in_order_and_end_with_one_done(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    alone = [session.ask(q, OPTS) for q in QUESTIONS]
    events = list(session.submit(list(QUESTIONS), OPTS))
    assert isinstance(events[-1], Done) and not any(isinstance(e, (Done, Failed)) for e in events[:-1])
    answered = [e for e in events if isinstance(e, Answered)]
    assert sorted(e.index for e in answered) == [0, 1, 2]
    for i, want in enumerate(alone):
        text = "".join(e.text for e in events if isinstance(e, Text) and e.index == i)
        (got,) = [e.answer for e in answered if e.index == i]
        assert got.answer_token_ids == want.answer_token_ids and text == got.answer == want.answer
        # every text event of an answer comes before its Answered event
        last_text = max((k for k, e in enumerate(events) if isinstance(e, Text) and e.index == i), default=-1)
        assert last_text < events.index(next(e for e in answered if e.index == i))
    assert [x.answer_token_ids for x in events[-1].answers] == [w.answer_token_ids for w in alone]


def test_cancel_mid_answer_ends_with_cancelled_and_frees_the_rows(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=4)
    request = engine.submit(session, [QUESTIONS[0], QUESTIONS[2]], LONG)
    seen = []
    for event in request:
        seen.append(event)
        if isinstance(event, Text):
            request.cancel()  # from the reader's own thread; the engine takes the rows out at its next step
    assert isinstance(seen[-1], Failed) and isinstance(seen[-1].error, Cancelled)
    assert sum(isinstance(e, (Done, Failed)) for e in seen) == 1
    wait_until(lambda: not engine.busy)
    request.cancel()  # after the end: harmless
    assert list(request) == []  # a finished request yields nothing more
    again = engine.ask(session, [QUESTIONS[1]], OPTS)[0]
    assert again.answer_token_ids == session.ask(QUESTIONS[1], OPTS).answer_token_ids


def test_cancel_from_another_thread_and_result_raises_the_one_exception(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=4)
    request = engine.submit(session, [QUESTIONS[0]], LONG)
    texts = threading.Event()
    canceller = threading.Thread(target=lambda: (texts.wait(60), request.cancel()))
    canceller.start()
    with pytest.raises(Cancelled):
        request.result(on_text=lambda i, t: texts.set())
    canceller.join(timeout=60)
    wait_until(lambda: not engine.busy)


def test_cancel_after_done_changes_nothing(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    request = session.submit([QUESTIONS[1]], OPTS)
    (answer,) = request.result()
    request.cancel()
    assert answer.answer_token_ids == session.ask(QUESTIONS[1], OPTS).answer_token_ids


def test_leaving_the_with_block_early_cancels(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=4)
    with engine.submit(session, [QUESTIONS[0]], LONG) as request:
        for event in request:
            if isinstance(event, Text):
                break
    wait_until(lambda: not engine.busy)  # its row left without anybody calling cancel()


def test_closing_the_engine_ends_a_waiting_request_with_engine_closed(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=4)
    request = engine.submit(session, [QUESTIONS[0]], LONG)
    events = iter(request)
    assert isinstance(next(events), Text)
    engine.close()
    rest = list(events)
    assert isinstance(rest[-1], Failed) and isinstance(rest[-1].error, EngineClosed)
    with pytest.raises(EngineClosed):
        engine.submit(session, [QUESTIONS[1]], OPTS).result()


def test_the_engine_admits_up_to_its_queue_and_refuses_the_rest_at_once(arch):
    """Admission is the engine's, for every front end: max_queue requests may wait beyond those decoding; one more is
    refused before any of it runs (EngineBusy, a ServerError), and is admitted again once a place is free."""
    from kvcli.engine.scheduling.requests import EngineBusy
    from kvcli.errors import ServerError

    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    engine = Engine(a.lm, width=1)
    engine.max_queue = 1
    try:
        with engine.turn():  # no step runs: whatever is admitted stays
            first = engine.submit(session, [QUESTIONS[0]], OPTS)
            second = engine.submit(session, [QUESTIONS[1]], OPTS)  # waits: one may
            asked = engine.asked
            with pytest.raises(EngineBusy, match="busy: 2 requests") as refused:
                engine.submit(session, [QUESTIONS[2]], OPTS)
            assert isinstance(refused.value, ServerError) and engine.asked == asked  # nothing of it was queued
            assert engine.in_use
        first.result(), second.result()
        third = engine.submit(session, [QUESTIONS[2]], OPTS).result()[0]
        assert third.answer_token_ids == session.ask(QUESTIONS[2], OPTS).answer_token_ids
        wait_until(lambda: not engine.in_use)  # every request read to its end: nothing holds the engine
    finally:
        engine.close()
