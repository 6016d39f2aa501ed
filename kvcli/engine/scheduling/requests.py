"""What a request to the engine reads back: typed events, and the two ways a request ends early.

An engine call (Engine.submit, Session.submit) returns a Request (engine/scheduling/scheduler.py): iterating
it yields Text and Answered events as the answers settle, then exactly one Done or Failed, and nothing after.
Imports nothing heavy, so front ends may catch these names without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Cancelled(Exception):
    """The request was cancelled (its asker left: request.cancel()); its rows left the engine."""


class EngineClosed(Exception):
    """The engine was closed (the server is stopping) before the answer was complete."""


@dataclass(frozen=True)
class Text:
    index: int  # which of the request's questions
    text: str  # answer text that is now final


@dataclass(frozen=True)
class Answered:
    index: int
    answer: Any  # engine.decoding.request.Answer


@dataclass(frozen=True)
class Failed:
    error: BaseException  # Cancelled, EngineClosed, or what the step or the question raised


@dataclass(frozen=True)
class Done:
    answers: list[Any]  # every question's Answer, in question order
