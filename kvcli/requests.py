"""What a front end asks of kvcli, as values: the model, one ask, one prefill (stdlib only: the served CLI imports it).

The CLI, the socket server (its wire form: serve/protocol.py) and the HTTP endpoint build the same values, so
a request is checked, defaulted and keyed in one place. A value is checked when it is made: a bad one raises
UsageError (exit 2) naming what is wrong; `from_wire` first checks the JSON shapes (ProtocolError).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .errors import UsageError
from .generation import GenerationOptions, check_options, check_trust

DEFAULT_RECOMPUTE = 0.15  # share of each later blended document recomputed (docs/composing.md, the measured curve)
SECTION_RECOMPUTE = 0.15  # share of each section recomputed (tests/bench/bench_sections.py measures it)


class ProtocolError(Exception):
    """A message that is not valid JSON lines of the socket protocol (serve/protocol.py)."""


@dataclass(frozen=True)
class ModelSpec:
    """What selects a loaded model. source: --model as given (hub id, folder, .gguf; None: the cache's own for an
    ask, $KVCLI_MODEL or the default for a prefill), or a source record already resolved (engine.model.models).
    dtype None: the cache's (an ask). `key` is the one name a model is held by."""

    source: str | Mapping[str, Any] | None = None
    revision: str | None = None
    device: str = "auto"
    dtype: str | None = None
    trust_remote_code: bool = False
    weights: str | None = None  # None: the source's default (engine.model.models.default_weights)

    @property
    def key(self) -> str:
        return json.dumps(["model", self.source, self.revision, self.device, self.dtype, self.trust_remote_code, self.weights],
                          sort_keys=True)

    def __hash__(self) -> int:
        return hash(self.key)

    def resolved(self, source: Mapping[str, Any], dtype: str | None) -> ModelSpec:
        """This spec with its source record (and dtype) resolved: what is loaded."""
        return replace(self, source=dict(source), revision=None, dtype=dtype)

    def to_wire(self) -> dict[str, Any]:
        """The socket protocol's model fields: a --model naming a local path made absolute for the server."""
        return {"model": _absolute(self.source), "revision": self.revision, "device": self.device, "dtype": self.dtype,
                "trust_remote_code": self.trust_remote_code, "weights": self.weights}

    @classmethod
    def from_wire(cls, req: Mapping[str, Any], *, dtype: str | None = None) -> ModelSpec:
        for name in ("model", "revision", "dtype", "weights"):
            if req.get(name) is not None and not isinstance(req.get(name), str):
                raise ProtocolError(f"{name} must be a string")
        return cls(source=req.get("model"), revision=req.get("revision"), device=req.get("device") or "auto",
                   dtype=req.get("dtype") or dtype, trust_remote_code=bool(req.get("trust_remote_code")),
                   weights=req.get("weights") or None)


@dataclass(frozen=True)
class Blend:
    """Several caches made one prompt (engine/cache/blend.py): `recompute` of each later document recomputed."""

    recompute: float = DEFAULT_RECOMPUTE

    def __post_init__(self) -> None:
        r = self.recompute
        if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r) or not 0.0 <= r <= 1.0:
            raise UsageError(f"--recompute {r}: give a fraction from 0 (only the glue) to 1 (exact)")
        object.__setattr__(self, "recompute", float(r))


@dataclass(frozen=True)
class Sections:
    """Which sections of a sectioned cache (engine/sections) each question uses: at most `count` of the best, or
    `every` one; `recompute` of each section recomputed so that it sees the sections before it."""

    count: int | None = None
    every: bool = False
    recompute: float = SECTION_RECOMPUTE

    def __post_init__(self) -> None:
        if self.count is not None and (type(self.count) is not int or self.count < 1):
            raise UsageError(f"--sections {self.count}: give a whole number of at least 1")
        if self.count is not None and self.every:
            raise UsageError("--sections N and --all choose the sections two ways: give one")
        r = self.recompute
        if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r) or not 0.0 <= r <= 1.0:
            raise UsageError(f"--recompute {r}: give a fraction from 0 (only the glue) to 1 (exact)")
        object.__setattr__(self, "recompute", float(r))

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj: Any) -> Sections:
        if not isinstance(obj, dict) or set(obj) - {"count", "every", "recompute"}:
            raise ProtocolError("sections must be an object of count, every and recompute")
        if not isinstance(obj.get("every", False), bool):
            raise ProtocolError("sections.every must be true or false")
        return cls(count=obj.get("count"), every=obj.get("every", False), recompute=obj.get("recompute", SECTION_RECOMPUTE))


@dataclass(frozen=True)
class SessionSpec:
    """One cache (or several blended into one prompt) to open against a model: what `open_session` opens."""

    caches: tuple[str, ...]
    model: ModelSpec = ModelSpec()
    convert_dtype: bool = False
    blend: Blend | None = None
    sections: Sections | None = None  # a sectioned cache: which sections each question uses (None: the defaults)

    @property
    def key(self) -> str:
        what = ["blend", list(self.caches), self.blend.recompute] if self.blend else ["cache", self.caches[0]]
        return json.dumps([*what, self.model.key, self.convert_dtype, self.sections.to_wire() if self.sections else None])

    @property
    def path(self) -> str | tuple[str, ...]:
        """The cache as messages name it: a path, or the blended paths."""
        return self.caches if self.blend else self.caches[0]


def check_caches(caches: Sequence[str]) -> None:
    if not caches:
        raise UsageError("--cache is required (the cache to answer from; make one with kvcli prefill DOC)")


def _options_wire(options: GenerationOptions) -> dict[str, Any]:
    return {**asdict(options), "stop": list(options.stop)}


@dataclass(frozen=True)
class AskRequest:
    """Questions answered from caches: each cache alone, or (blend) all of them as one prompt.

    history: the conversation the questions follow ((question, answer) pairs); follow_up: instead, an
    `ask --json` answer (follow_up_name: its file, for messages), checked against each cache when it opens."""

    caches: tuple[str, ...]
    questions: tuple[str, ...]
    options: GenerationOptions = field(default_factory=GenerationOptions)
    model: ModelSpec = ModelSpec()
    convert_dtype: bool = False
    blend: Blend | None = None
    batch_size: int | None = None
    check: bool = False
    stream: bool = True
    history: tuple[tuple[str, str], ...] = ()
    follow_up: Mapping[str, Any] | None = None
    follow_up_name: str = "--follow-up"
    sections: Sections | None = None  # a sectioned cache's choice of sections (None: the defaults)

    def __post_init__(self) -> None:
        check_caches(self.caches)
        if not self.questions:
            raise UsageError("no question given (arguments, -f FILE, or text on stdin)")
        if self.blend is not None and len(self.caches) < 2:
            raise UsageError("--blend makes one prompt of several caches: give --cache at least twice")
        if self.blend is not None and (self.follow_up is not None or self.history):
            raise UsageError("--follow-up cannot continue a blended prompt: ask the follow-up with the documents blended again")
        if self.batch_size is not None and (type(self.batch_size) is not int or self.batch_size < 1):
            raise UsageError("--batch-size must be a whole number of at least 1")
        check_trust(self.model.trust_remote_code, self.model.source)

    def sessions(self) -> list[SessionSpec]:
        """What to open, in order: one SessionSpec per cache, or one for the blend."""
        groups = [self.caches] if self.blend else [(c,) for c in self.caches]
        return [SessionSpec(g, self.model, self.convert_dtype, self.blend, self.sections) for g in groups]

    def to_wire(self) -> dict[str, Any]:
        """The socket protocol's ask fields (serve/protocol.py); cache paths made absolute for the server."""
        model = self.model.to_wire()
        del model["weights"]
        fields = {"caches": [os.path.abspath(c) for c in self.caches], "questions": list(self.questions),
                  "options": _options_wire(self.options), **model, "convert_dtype": self.convert_dtype,
                  "stream": self.stream, "batch_size": self.batch_size}
        if self.blend is not None:
            fields["blend"] = self.blend.recompute
        if self.sections is not None:
            fields["sections"] = self.sections.to_wire()
        if self.follow_up is not None:
            fields.update(follow_up=dict(self.follow_up), follow_up_name=self.follow_up_name)
        elif self.history:
            fields["history"] = [list(h) for h in self.history]
        return fields

    @classmethod
    def from_wire(cls, req: Mapping[str, Any]) -> AskRequest:
        """The request a socket client sent: shapes checked (ProtocolError), then the values (UsageError)."""
        o = req.get("options") or {}
        if not isinstance(o, dict):
            raise ProtocolError("options must be an object")
        blend = req.get("blend")
        if blend is not None and (isinstance(blend, bool) or not isinstance(blend, (int, float))):
            raise ProtocolError("blend must be a fraction from 0 to 1")
        batch_size = req.get("batch_size")
        if batch_size is not None and (type(batch_size) is not int or batch_size < 1):
            raise ProtocolError("batch_size must be a whole number of at least 1")
        follow_up = req.get("follow_up")
        if follow_up is not None and not isinstance(follow_up, dict):
            raise ProtocolError("follow_up must be an `ask --json` answer object")
        return cls(caches=tuple(_strings(req, "caches")), questions=tuple(_strings(req, "questions")),
                   options=GenerationOptions(**check_options(o)), model=ModelSpec.from_wire(req),
                   convert_dtype=bool(req.get("convert_dtype")), blend=None if blend is None else Blend(blend),
                   batch_size=batch_size, stream=bool(req.get("stream", True)), history=_history(req.get("history")),
                   follow_up=follow_up, follow_up_name=str(req.get("follow_up_name") or "--follow-up"),
                   sections=None if req.get("sections") is None else Sections.from_wire(req["sections"]))


@dataclass(frozen=True)
class PrefillRequest:
    """Documents prefilled into caches: (document, cache) pairs and how the prompt is framed and stored."""

    docs: tuple[tuple[str, str], ...]
    model: ModelSpec = ModelSpec(dtype="auto")
    system: str | None = None
    framing: str = "auto"
    chunk_size: int | None = None
    encoding: str = "utf-8"
    force: bool = False
    kv_bits: int | None = None
    after: str | None = None
    compression: str | None = None  # lossless storage: "small" (None) or "fast"
    window: int | None = None  # positions a question's prompt may use; a longer document is sectioned (in process only)

    def __post_init__(self) -> None:
        from .format.manifest import check_kv_bits

        check_kv_bits(self.kv_bits)
        if self.compression not in (None, "small", "fast"):
            raise UsageError(f"--compression must be small or fast, got {self.compression!r}")
        if self.chunk_size is not None and (type(self.chunk_size) is not int or self.chunk_size < 1):
            raise UsageError("--chunk-size must be a whole number of at least 1")

    def options(self) -> dict[str, Any]:
        """The options engine.corpus.run takes for every document."""
        return {"system": self.system, "framing": self.framing, "chunk_size": self.chunk_size, "force": self.force,
                "kv_bits": self.kv_bits, "after": self.after, "compression": self.compression,
                **({"window": self.window} if self.window is not None else {})}

    def to_wire(self) -> dict[str, Any]:
        """The socket protocol's prefill fields (a window is prefilled in process, never sent)."""
        options = {k: v for k, v in self.options().items() if k != "window"}
        return {"docs": [[os.path.abspath(d), os.path.abspath(t)] for d, t in self.docs], **self.model.to_wire(),
                "encoding": self.encoding, **options,
                "after": os.path.abspath(self.after) if self.after is not None else None}

    @classmethod
    def from_wire(cls, req: Mapping[str, Any]) -> PrefillRequest:
        pairs = req.get("docs")
        if not isinstance(pairs, list) or not pairs or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in pairs):
            raise ProtocolError("docs must be a non-empty list of [document, cache] paths")
        after = req.get("after")
        if after is not None and not isinstance(after, str):
            raise ProtocolError("after must be a cache path")
        from .format.manifest import check_kv_bits

        kv_bits = check_kv_bits(req.get("kv_bits"), "kv_bits")
        compression = req.get("compression")
        if compression not in (None, "small", "fast"):
            raise ProtocolError("compression must be small or fast")
        return cls(docs=tuple((d, t) for d, t in pairs), model=ModelSpec.from_wire(req, dtype="auto"), system=req.get("system"),
                   framing=req.get("framing") or "auto", chunk_size=req.get("chunk_size"),
                   encoding=req.get("encoding") or "utf-8", force=bool(req.get("force")), kv_bits=kv_bits, after=after,
                   compression=compression)


def _absolute(source: Any) -> Any:
    """A --model that names a local path, made absolute (a hub id stays as it is)."""
    if isinstance(source, str) and (os.path.exists(source) or source.endswith(".gguf") or source.startswith((".", "/", "~"))
                                    or source.count("/") > 1):
        return os.path.abspath(os.path.expanduser(source))
    return source


def _strings(req: Mapping[str, Any], name: str) -> list[str]:
    value = req.get(name)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"{name} must be a non-empty list of strings")
    return value


def _history(history: Any) -> tuple[tuple[str, str], ...]:
    history = history or []
    if not isinstance(history, list) or not all(
            isinstance(h, list) and len(h) == 2 and all(isinstance(t, str) for t in h) for h in history):
        raise ProtocolError("history must be a list of [question, answer] pairs")
    return tuple((q, a) for q, a in history)


def options_from(values: Mapping[str, Any], names: Mapping[str, str] | None = None, *,
                 max_new_tokens_cap: int | None = None) -> GenerationOptions:
    """GenerationOptions from a front end's values, through the one check (generation.check_options)."""
    checked = check_options(values, names, max_new_tokens_cap=max_new_tokens_cap) if names else check_options(
        values, max_new_tokens_cap=max_new_tokens_cap)
    return GenerationOptions(**checked)


__all__ = ["AskRequest", "Blend", "DEFAULT_RECOMPUTE", "ModelSpec", "PrefillRequest", "ProtocolError", "SessionSpec",
           "options_from"]
