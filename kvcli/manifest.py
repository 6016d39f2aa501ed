"""The cache manifest: its schema, strict validation and self-checksum. Pure Python, no torch.

A manifest is trusted only after every field has the expected type and range, shard names are
plain file names, sizes agree with shapes, and its checksum over its own canonical JSON matches.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import CacheCorruptError, CacheVersionError

FORMAT_NAME = "kvcli-cache"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # token ids of a 1M-token document fit with room to spare
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYER_KINDS = ("full", "sliding")
_SHARD_NAME = re.compile(r"^layer_[0-9]{3,6}\.safetensors\.zst$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_DIM = 1 << 24


@dataclass(frozen=True)
class LayerEntry:
    index: int
    kind: str  # "full" or "sliding"
    cached_length: int  # tokens whose keys/values are stored
    seq_length: int  # tokens the layer has seen (counted length; > cached_length for a full sliding window)
    sliding_window: int | None
    file: str
    key_shape: tuple[int, ...]  # [batch, kv_heads, cached_length, head_dim]
    value_shape: tuple[int, ...]
    raw_bytes: int
    decoded_bytes: int
    stored_bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    format_version: int
    kvcli_version: str
    transformers_version: str
    created: str
    model: dict[str, Any]  # source, name, model_type, config/tokenizer/chat template hashes, dtype, sizes
    framing: dict[str, Any]  # kind ("chat" | "plain"), system, template hash
    document: dict[str, Any]  # name, sha256, chars
    token_ids: list[int]
    compression: dict[str, Any]  # codec, level, transform
    layers: list[LayerEntry] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def dtype(self) -> str:
        return self.model["dtype"]

    @property
    def transform(self) -> str:
        return self.compression.get("transform", "none")

    @property
    def bytes_raw(self) -> int:
        return sum(layer.raw_bytes for layer in self.layers)

    @property
    def bytes_stored(self) -> int:
        return sum(layer.stored_bytes for layer in self.layers)

    def to_json(self) -> dict[str, Any]:
        body = {"format": FORMAT_NAME, **asdict(self)}
        for layer in body["layers"]:
            layer["key_shape"] = list(layer["key_shape"])
            layer["value_shape"] = list(layer["value_shape"])
        body["manifest_sha256"] = checksum(body)
        return body

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode() + b"\n"


def checksum(body: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of everything but the checksum field itself."""
    rest = {k: v for k, v in body.items() if k != "manifest_sha256"}
    canon = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def _bad(where: str, what: str) -> CacheCorruptError:
    return CacheCorruptError(f"{where}: {what}")


def _get(obj: dict, key: str, types: type | tuple, where: str, *, optional: bool = False) -> Any:
    if key not in obj:
        if optional:
            return None
        raise _bad(where, f"manifest field '{key}' is missing")
    value = obj[key]
    if optional and value is None:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _bad(where, f"manifest field '{key}' has the wrong type")
    if not isinstance(value, types):
        raise _bad(where, f"manifest field '{key}' has the wrong type")
    return value


def _int(obj: dict, key: str, where: str, lo: int, hi: int, *, optional: bool = False) -> int | None:
    value = _get(obj, key, int, where, optional=optional)
    if value is not None and not lo <= value <= hi:
        raise _bad(where, f"manifest field '{key}' = {value} is out of range")
    return value


def _str(obj: dict, key: str, where: str, *, optional: bool = False, pattern: re.Pattern | None = None) -> str | None:
    value = _get(obj, key, str, where, optional=optional)
    if value is not None and pattern is not None and not pattern.match(value):
        raise _bad(where, f"manifest field '{key}' is malformed")
    return value


def _shape(obj: dict, key: str, where: str) -> tuple[int, ...]:
    value = _get(obj, key, list, where)
    if len(value) != 4 or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_DIM for v in value):
        raise _bad(where, f"manifest field '{key}' is not a 4-d shape")
    return tuple(value)


def parse(raw: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; raise CacheCorruptError / CacheVersionError naming `where`."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _bad(where, f"manifest is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(body, dict):
        raise _bad(where, "manifest is not a JSON object")
    if body.get("format") != FORMAT_NAME:
        raise _bad(where, "not a kvcli cache manifest")
    version = body.get("format_version")
    if version != FORMAT_VERSION:
        raise CacheVersionError(f"{where}: cache format version {version!r} is not supported (this kvcli reads {FORMAT_VERSION})")
    if body.get("manifest_sha256") != checksum(body):
        raise _bad(where, "manifest checksum does not match its content (edited or damaged)")
    for key in ("model", "framing", "document", "compression"):
        _get(body, key, dict, where)
    model = body["model"]
    dtype = _str(model, "dtype", where)
    if dtype not in DTYPE_SIZES:
        raise _bad(where, f"unsupported dtype {dtype!r}")
    for key in ("num_layers", "num_kv_heads", "head_dim"):
        _int(model, key, where, 1, MAX_DIM)
    for key in ("config_sha256", "weights_sha256", "tokenizer_sha256"):
        _str(model, key, where, pattern=_SHA256)
    _str(model, "model_type", where)
    _get(model, "source", dict, where)
    framing = body["framing"]
    if _str(framing, "kind", where) not in ("chat", "plain"):
        raise _bad(where, "unknown prompt framing")
    _str(framing, "system", where, optional=True)
    document = body["document"]
    _str(document, "sha256", where, pattern=_SHA256)
    _int(document, "chars", where, 0, 1 << 40)
    compression = body["compression"]
    if compression.get("codec") != "zstd" or compression.get("transform", "none") not in ("none", "byteplane"):
        raise _bad(where, "unknown compression")
    token_ids = _get(body, "token_ids", list, where)
    if not token_ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < (1 << 31) for t in token_ids):
        raise _bad(where, "token_ids must be a non-empty list of non-negative integers")
    layers_raw = _get(body, "layers", list, where)
    if len(layers_raw) != model["num_layers"]:
        raise _bad(where, f"{len(layers_raw)} layers listed, model has {model['num_layers']}")
    layers = [_layer(entry, i, len(token_ids), model, where) for i, entry in enumerate(layers_raw)]
    if len({layer.file for layer in layers}) != len(layers):
        raise _bad(where, "two layers name the same shard file")
    for key in ("kvcli_version", "transformers_version", "created"):
        _str(body, key, where)
    return Manifest(
        format_version=version,
        kvcli_version=body["kvcli_version"],
        transformers_version=body["transformers_version"],
        created=body["created"],
        model=model,
        framing=framing,
        document=document,
        token_ids=token_ids,
        compression=compression,
        layers=layers,
    )


def _layer(entry: Any, i: int, num_tokens: int, model: dict, where: str) -> LayerEntry:
    w = f"{where} (layer {i})"
    if not isinstance(entry, dict):
        raise _bad(w, "layer entry is not an object")
    if _int(entry, "index", w, 0, MAX_DIM) != i:
        raise _bad(w, "layer index out of order")
    kind = _str(entry, "kind", w)
    if kind not in LAYER_KINDS:
        raise _bad(w, f"unknown layer kind {kind!r}")
    window = _int(entry, "sliding_window", w, 1, 1 << 31, optional=True)
    if (kind == "sliding") != (window is not None):
        raise _bad(w, "sliding_window must be given exactly for sliding layers")
    seq_length = _int(entry, "seq_length", w, 0, 1 << 31)
    cached = _int(entry, "cached_length", w, 0, 1 << 31)
    expect_cached = num_tokens if kind == "full" else min(num_tokens, window - 1)
    if seq_length != num_tokens or cached != expect_cached:
        raise _bad(w, f"lengths {cached}/{seq_length} do not fit {num_tokens} cached tokens")
    name = _str(entry, "file", w)
    if not _SHARD_NAME.match(name):
        raise _bad(w, f"shard name {name!r} is not a plain layer file name")
    key_shape, value_shape = _shape(entry, "key_shape", w), _shape(entry, "value_shape", w)
    for shape in (key_shape, value_shape):
        if shape[0] != 1 or shape[1] != model["num_kv_heads"] or shape[2] != cached:
            raise _bad(w, f"shape {list(shape)} does not fit the model and {cached} tokens")
    if key_shape[3] != model["head_dim"]:
        raise _bad(w, f"key head_dim {key_shape[3]} does not match the model's {model['head_dim']}")
    item = DTYPE_SIZES[model["dtype"]]
    raw = item * (_numel(key_shape) + _numel(value_shape))
    if _int(entry, "raw_bytes", w, 0, 1 << 48) != raw:
        raise _bad(w, f"raw_bytes does not match shapes ({raw})")
    decoded = _int(entry, "decoded_bytes", w, 0, 1 << 48)
    if not raw < decoded <= raw + 8 + 64 * 1024:
        raise _bad(w, "decoded_bytes does not fit the shapes")
    _int(entry, "stored_bytes", w, 1, 1 << 48)
    _str(entry, "sha256", w, pattern=_SHA256)
    return LayerEntry(
        index=i,
        kind=kind,
        cached_length=cached,
        seq_length=seq_length,
        sliding_window=window,
        file=name,
        key_shape=key_shape,
        value_shape=value_shape,
        raw_bytes=raw,
        decoded_bytes=decoded,
        stored_bytes=entry["stored_bytes"],
        sha256=entry["sha256"],
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
