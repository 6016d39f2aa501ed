"""OpenAI chat-completions (and legacy text completions) shapes without a web framework: request checking,
responses, chunks, errors.

Only what kvcli answers is accepted; a field kvcli cannot honour (n > 1, logprobs, tools) is a 400 naming
it, never silently ignored. Fields kvcli has no use for (user, metadata, ...) are ignored.
Unlike OpenAI, an omitted temperature means 0 (greedy): answers equal the model's answer on the full prompt.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine.prompt import conversation
from ..errors import ConversationError
from ..generation import DEFAULT_MAX_NEW_TOKENS, GenerationOptions, OptionError, check_options
from ..requests import SECTION_RECOMPUTE, Blend, Sections

BLEND_MODEL = "kvcli-blend"  # the model id a request blending `documents` may name instead of the first document
HTTP_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop"}


class ApiError(Exception):
    """An HTTP error in OpenAI's error object shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked chat-completions body: the conversation, its generation options, and kvcli's blend fields."""

    model: str
    system: str | None
    history: list[conversation.Exchange]
    question: str
    options: GenerationOptions
    stream: bool
    include_usage: bool
    documents: list[str] | None = None  # caches blended into one prompt, in order (kvcli's field; `model` is BLEND_MODEL or the first)
    blend: Blend | None = None  # with documents: the share of each later document recomputed
    sections: Sections | None = None  # a sectioned cache's choice of sections (kvcli's `sections` field; None: the defaults)
    text: bool = False  # a /v1/completions request: answered in the text_completion shape

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.options.stop)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi or (lo_open and value == lo):  # NaN too
        raise _bad(name, f"must be a number {'above' if lo_open else 'from'} {lo:g} {'up to' if lo_open else 'to'} {hi:g}")
    return float(value)


def parse_chat(body: Any, *, max_tokens: int | None = None) -> ChatRequest:
    """Check a chat-completions body; ApiError(400) names the first bad field. max_tokens: the server's cap
    on max_tokens / max_completion_tokens (a request above it is a 400, as vLLM answers one past the context)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "required: the id of a cache (see GET /v1/models)")
    try:
        system, history, question = conversation.from_messages(body.get("messages"))
    except ConversationError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
    token_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    temperature = _number(body, "temperature", 0, 2)  # OpenAI's range; the rest is kvcli's one check (generation.py)
    stop = body.get("stop")
    if isinstance(stop, str):  # OpenAI's one stop string: a list of one, never one stop per character
        stop = [stop]
    if isinstance(stop, list) and len(stop) > 4:
        raise _bad("stop", "at most 4 stop strings")
    names = {**HTTP_NAMES, "max_new_tokens": token_field}
    try:
        checked = check_options({"max_new_tokens": body.get(token_field), "temperature": temperature,
                                 "top_p": body.get("top_p"), "seed": body.get("seed"), "stop": stop}, names,
                                max_new_tokens_cap=max_tokens)
        checked.setdefault("max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, max_tokens or DEFAULT_MAX_NEW_TOKENS))
    except OptionError as exc:
        param = names.get(exc.field, exc.field)
        raise ApiError(400, str(exc), param=param,
                       code="max_tokens_exceeded" if "--max-tokens" in str(exc) else None) from None
    if body.get("n") not in (None, 1):
        raise _bad("n", "only n=1 is supported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise _bad("stream", "must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    for name in ("logprobs", "tools", "functions", "tool_choice", "audio"):
        if body.get(name) not in (None, False, [], "none"):
            raise _bad(name, "not supported by kvcli")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("response_format", "only {\"type\": \"text\"} is supported")
    sections = _sections(body)
    documents, blend = _documents(body, model, sections)
    if documents is not None and history:
        raise _bad("documents", "a blended prompt answers one question: send the question without earlier turns")
    return ChatRequest(model=model, system=system, history=history, question=question, documents=documents, blend=blend,
                       sections=sections, options=GenerationOptions(**checked), stream=bool(stream),
                       include_usage=bool(options.get("include_usage")))


def parse_completion(body: Any, *, max_tokens: int | None = None) -> ChatRequest:
    """Check a legacy /v1/completions body: its `prompt` is the question (one user turn after the document), the
    rest as parse_chat checks it; `echo`, `suffix` and best_of > 1 cannot be honoured (400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise _bad("prompt", "must be one non-empty string (the question about the document)")
    if body.get("echo") not in (None, False):
        raise _bad("echo", "not supported by kvcli")
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", "not supported by kvcli")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "only best_of=1 is supported")
    chat = {k: v for k, v in body.items() if k not in ("prompt", "echo", "suffix", "best_of", "messages", "max_completion_tokens")}
    chat["max_tokens"] = body.get("max_tokens", min(16, max_tokens or 16))  # the legacy endpoint's own default
    req = parse_chat({**chat, "messages": [{"role": "user", "content": prompt}]}, max_tokens=max_tokens)
    req.text = True
    return req


def _sections(body: dict) -> Sections | None:
    """kvcli's `sections` field (a sectioned cache's sections each question uses: a whole number N, the N that best
    match it, as `ask --sections N`; or "all", every one in document order, as `ask --all`) with its `recompute` (the
    share of each section recomputed, as `ask --recompute`), checked: the Sections value `kvcli ask` builds."""
    value = body.get("sections")
    if value is None:
        return None
    if value == "all":
        count, every = None, True
    elif type(value) is int and value >= 1:
        count, every = value, False
    else:
        raise _bad("sections", 'must be a whole number of at least 1 (the sections each question uses) or "all"')
    if body.get("documents") is not None:
        raise _bad("sections", "chooses a sectioned cache's sections, which is never blended: send it without documents")
    fraction = _number(body, "recompute", 0, 1)
    return Sections(count=count, every=every, recompute=SECTION_RECOMPUTE if fraction is None else fraction)


def _documents(body: dict, model: str, sections: Sections | None = None) -> tuple[list[str] | None, Blend | None]:
    """kvcli's `documents` (cache ids blended into one prompt, in order) and `recompute` fields, checked."""
    documents, recompute = body.get("documents"), body.get("recompute")
    if documents is None:
        if recompute is not None and sections is None:
            raise _bad("recompute", "only with documents (the caches blended into one prompt) or sections (a sectioned "
                                    "cache's)")
        return None, None
    if not isinstance(documents, list) or len(documents) < 2 or not all(isinstance(d, str) and d for d in documents):
        raise _bad("documents", "must be a list of at least two cache ids (see GET /v1/models)")
    if model not in (BLEND_MODEL, documents[0]):
        raise _bad("model", f"with documents: '{BLEND_MODEL}' or the first document's id")
    fraction = _number(body, "recompute", 0, 1)
    return documents, Blend() if fraction is None else Blend(fraction)


def model_entry(model_id: str, row: dict[str, Any], scrub=lambda text: text) -> dict[str, Any]:
    """One /v1/models entry: OpenAI's fields plus kvcli's own metadata under "kvcli" (no server path: the id
    names the cache; scrub(text) takes paths out of a model recorded by its folder)."""
    created = int(time.time() - (row.get("age_s") or 0.0))
    meta = {k: row.get(k) for k in ("num_tokens", "model", "model_type", "dtype", "bytes_on_disk", "bytes_raw")}
    if isinstance(meta["model"], str):
        meta["model"] = scrub(meta["model"])
    meta["document"] = (row.get("document") or {}).get("name")
    meta["system"] = (row.get("framing") or {}).get("system")
    return {"id": model_id, "object": "model", "created": created, "owned_by": "kvcli", "kvcli": meta}


def usage(answer: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage block of an answer record (Answer.to_json(), as `ask --json` prints it)."""
    prompt, completion = len(answer["prompt_token_ids"]), len(answer["answer_token_ids"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": answer["cached_tokens"]}}


def completion_id(text: bool = False) -> str:
    return f"{'cmpl' if text else 'chatcmpl'}-{uuid.uuid4().hex}"


def completion(cid: str, model: str, answer: dict[str, Any], *, text: bool = False) -> dict[str, Any]:
    """The non-streamed chat.completion object of an answer record (text: the legacy text_completion)."""
    choice = ({"index": 0, "text": answer["answer"]} if text else
              {"index": 0, "message": {"role": "assistant", "content": answer["answer"]}})
    blended = answer.get("blended")
    return {
        "id": cid, "object": "text_completion" if text else "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{**choice, "finish_reason": answer["finish_reason"], "logprobs": None}],
        "usage": usage(answer),
        "kvcli": {"ttft_s": answer["ttft_s"], "total_s": answer["total_s"], "processed_tokens": answer["processed_tokens"],
                  **({"blended": {k: v for k, v in blended.items() if k != "caches"}} if blended else {}),
                  **sources(answer)},
    }


def sources(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer record from a sectioned cache: the sections it used (lines, pages, headings, score) and their share of
    the document, kvcli's own fields; nothing for any other cache."""
    return {k: answer[k] for k in ("sources", "document_share") if answer.get(k) is not None}


def chunk(cid: str, model: str, *, delta: dict[str, Any] | None = None, finish_reason: str | None = None,
          answer: dict[str, Any] | None = None, with_choice: bool = True, text: bool = False,
          kvcli: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chat.completion.chunk: a content delta, the closing finish_reason, or (choices empty) the usage;
    text: a legacy text_completion chunk, its delta's content as `text`; kvcli: kvcli's own fields (the closing
    chunk's sources)."""
    out: dict[str, Any] = {"id": cid, "object": "text_completion" if text else "chat.completion.chunk", "created": int(time.time()),
                           "model": model, "choices": []}
    if with_choice:
        part = {"text": (delta or {}).get("content", "")} if text else {"delta": delta or {}}
        out["choices"] = [{"index": 0, **part, "finish_reason": finish_reason, "logprobs": None}]
    if answer is not None:
        out["usage"] = usage(answer)
    if kvcli:
        out["kvcli"] = kvcli
    return out
