"""The one check of generation options and their defaults, whichever front end they come from (stdlib only: the
CLI imports it at --help time).

The CLI, the socket server (serve/handlers.py) and the HTTP endpoint (serve/openai_api.py) all hand their
options to `check_options`, so the same bad value gets the same refusal everywhere; only the spelling of
an option's name differs (CLI_NAMES: `--top-p`, the spelling a socket client's user typed; the HTTP
endpoint names OpenAI's fields). A `stop` given as one string is refused, never split into characters
(the HTTP endpoint turns OpenAI's string `stop` into a list of one before it gets here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

DEFAULT_MAX_NEW_TOKENS = 256  # answer tokens when no --max-new-tokens is given
DEFAULT_BATCH = 8  # rows one document decodes together (docs/serving.md, "Many questions at once")
DEFAULT_STOP_LOOPS = 12  # the command line's --stop-loops: an answer ends when its last 12 ids come a third time
DEFAULT_HTTP_MAX_TOKENS = 4096  # most answer tokens one HTTP request may ask for (serve --max-tokens)


@dataclass
class GenerationOptions:
    """How one answer is generated (checked by check_options before it is made)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    # generate()'s own anti-repetition settings; like generate() they see every prompt id (document included).
    repetition_penalty: float = 1.0  # 1.0: off; >1 makes tokens already seen less likely
    no_repeat_ngram_size: int = 0  # 0: off; n>0 never repeats an n-gram of the prompt or answer
    # n>0 ends an answer ("loop") once its last n ids have come three times in it; the ids before are unchanged
    stop_loops: int = 0


class OptionError(UsageError):
    """A generation option the front ends refuse (exit 2); `field` is the option's library name."""

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # not NaN, not infinite


SEED_MAX = 2**64 - 1  # torch's generators take a seed of 64 bits


# field -> (whether a value is acceptable, what it must be otherwise, the value as GenerationOptions takes it)
RULES: dict[str, tuple[Callable[[Any], bool], str, Callable[[Any], Any]]] = {
    "max_new_tokens": (lambda v: _is_int(v) and v >= 1, "a whole number of at least 1", int),
    "temperature": (lambda v: _is_number(v) and v >= 0, "a finite number of at least 0 (0: greedy)", float),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "above 0 and at most 1", float),
    "seed": (lambda v: _is_int(v) and 0 <= v <= SEED_MAX, f"a whole number from 0 to {SEED_MAX}", int),
    "stop": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v),
             "a list of non-empty strings", tuple),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a finite number above 0 (1 is off)", float),
    "no_repeat_ngram_size": (lambda v: _is_int(v) and v >= 0, "a whole number of at least 0 (0: off)", int),
    "stop_loops": (lambda v: _is_int(v) and v >= 0, "a whole number of at least 0 (0: never)", int),
}
FIELDS = tuple(RULES)
CLI_NAMES = {f: "--" + f.replace("_", "-") for f in FIELDS}


def check_options(values: Mapping[str, Any], names: Mapping[str, str] | Callable[[str], str] = CLI_NAMES, *,
                  max_new_tokens_cap: int | None = None) -> dict[str, Any]:
    """The checked keyword arguments of GenerationOptions from `values` (omitted or None: the default).

    Raises OptionError naming the first bad option as `names` spells it. max_new_tokens_cap: a server's
    limit on max_new_tokens (HTTP --max-tokens)."""
    name = names if callable(names) else (lambda f: names.get(f, f))
    extra = sorted(set(values) - set(FIELDS))
    if extra:
        raise OptionError(f"unknown options: {', '.join(extra)}", field=extra[0])

    def bad(f: str, what: str) -> OptionError:
        return OptionError(f"{name(f)} must be {what}", field=f)

    out: dict[str, Any] = {}
    for f, (ok, what, convert) in RULES.items():
        v = values.get(f)
        if v is None:
            continue
        if f == "stop" and isinstance(v, str):
            raise bad(f, "a list of strings, not one string (each item is one stop string)")
        if not ok(v):
            raise bad(f, what)
        if f == "max_new_tokens" and max_new_tokens_cap is not None and v > max_new_tokens_cap:
            raise bad(f, f"at most {max_new_tokens_cap} (this server's --max-tokens)")
        out[f] = convert(v)
    return out


def check_trust(trust_remote_code: Any, model: Any) -> None:
    """--trust-remote-code only with an explicit --model: a cache must not choose whose code runs."""
    if trust_remote_code and not model:
        raise UsageError("--trust-remote-code needs an explicit --model: a cache must not choose whose code runs")
