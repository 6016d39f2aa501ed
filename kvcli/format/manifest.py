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

from ..errors import CacheVersionError, UsageError
from . import chain, payload, sections as sec
from .dtypes import ITEM_SIZES
from .fields import MAX_DIM, bad, document_record, get_field, int_field, model_source as _source, numel, shape_field, str_field

FORMAT_NAME = "kvcli-cache"
FORMAT_VERSION = 3  # what kvcli writes: shards hashed with BLAKE3, lossless or quantized (compression.quant)
LOSSLESS_SHA256_VERSION = 1  # older caches, still read: lossless, shards hashed with sha256
QUANT_SHA256_VERSION = 2  # older 8-/4-bit caches (a kvcli that reads only 1 says "version 2 not supported")
SECTIONED_VERSION = sec.SECTIONED_VERSION  # a document longer than the window: sections read one by one (format/sections.py)
SUPPORTED_VERSIONS = (LOSSLESS_SHA256_VERSION, QUANT_SHA256_VERSION, FORMAT_VERSION, SECTIONED_VERSION)
# The hash of every shard's stored bytes, by format version; a layer entry names it as its digest's key. BLAKE3 hashes
# about twice as fast as sha256 with SHA extensions, and restore hashes every byte it reads (docs/performance.md).
SHARD_HASHES = {LOSSLESS_SHA256_VERSION: "sha256", QUANT_SHA256_VERSION: "sha256", FORMAT_VERSION: "blake3", SECTIONED_VERSION: "blake3"}
KV_BITS = (8, 4)
FRAMING_VERSION = 1  # recorded when the cut is at the document's end (no anchor, nothing pending)
FRAMING_VERSION_CUT = 2  # recorded when the cache holds anchor / pending text (engine/prompt/framing.py)
FRAMING_VERSIONS = (FRAMING_VERSION, FRAMING_VERSION_CUT)
MAX_GROUP = 1 << 16
_QUANT_KEYS = {"bits", "group_size", "exact_tokens", "scale_dtype", "keys", "values"}
_QUANT_OPTIONAL = {"recent_tokens"}  # the last tokens kept exact; caches written before it have none (0)
QUANT_AXES = {"keys": "per_channel", "values": "per_token"}  # keys: groups of tokens in one channel; values: of channels in one token
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # token ids of a 1M-token document fit with room to spare
DTYPE_SIZES = ITEM_SIZES  # bytes per element of each storable dtype (format/dtypes.py)
LAYER_KINDS = ("full", "sliding")
_SHARD_NAME = re.compile(r"^layer_[0-9]{3,6}\.safetensors\.zst$")
_SHA256 = _HEX256 = re.compile(r"^[0-9a-f]{64}$")
# Generous ceilings far above any real model; the model-dependent checks (engine/fit.check_fits) are stricter.
MAX_LAYERS = 4096
MAX_KV_HEADS = 4096
MAX_HEAD_DIM = 8192
MAX_TOKENS = 1 << 24
_TOP_KEYS = {"format", "format_version", "manifest_sha256", "kvcli_version", "transformers_version", "created",
             "model", "framing", "document", "token_ids", "compression", "layers", "provenance", "base", "sections"}
# What computed the keys/values (optional: caches written before 0.1 provenance lack it). Other kernels
# give logits that differ in the last bits, which can flip a greedy token where the top two nearly tie.
PROVENANCE_KEYS = ("torch_version", "device_type", "attn_implementation")
_LAYER_KEYS = {"index", "kind", "cached_length", "seq_length", "sliding_window", "file", "key_shape", "value_shape",
               "raw_bytes", "decoded_bytes", "stored_bytes"}  # plus the digest, keyed by the version's shard hash


def check_kv_bits(bits: object, name: str = "--kv-bits") -> int | None:
    """The storage a writer was asked for: one of KV_BITS, or None (lossless); UsageError naming `name` otherwise."""
    if bits is not None and (type(bits) is not int or bits not in KV_BITS):
        raise UsageError(f"{name} must be {' or '.join(map(str, KV_BITS))} (or absent for lossless), got {bits!r}")
    return bits


def shard_name(index: int) -> str:
    """The one file name layer `index` may have (a manifest naming anything else is refused)."""
    return f"layer_{index:03d}.safetensors.zst"


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
    digest: str  # hex digest of the stored bytes, with the manifest's shard_hash (manifest key: that hash's name)

    def to_json(self, shard_hash: str) -> dict[str, Any]:
        """The layer's manifest entry, its digest under the key of the manifest's shard hash."""
        body = asdict(self)
        body[shard_hash] = body.pop("digest")
        body["key_shape"], body["value_shape"] = list(self.key_shape), list(self.value_shape)
        return body


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
    provenance: dict[str, str] | None = None  # torch_version, device_type, attn_implementation
    base: dict[str, Any] | None = None  # the cache this one extends: manifest_sha256, path, num_tokens (chain.py)
    sections: sec.Sections | None = None  # format 4: the document's sections; token_ids and layers are then the head's

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def base_tokens(self) -> int:
        """Tokens held by the chain below this cache (0 for a cache that extends none); full layers store the rest."""
        return self.base["num_tokens"] if self.base else 0

    @property
    def digest(self) -> str:
        """The manifest's own checksum: what a cache that extends this one records."""
        return self.to_json()["manifest_sha256"]

    @property
    def dtype(self) -> str:
        return self.model["dtype"]

    @property
    def weights(self) -> str:
        """The arithmetic that computed the keys/values: "float", "q8" or "q4" (engine/model/stored.py)."""
        return self.model.get("weights", "float")

    @property
    def model_name(self) -> str | None:
        """The model's name as messages and `info` print it: its source's, else the config's."""
        return self.model.get("source", {}).get("name") or self.model.get("name")

    @property
    def shard_hash(self) -> str:
        """The hash of the shards' stored bytes: "blake3" (format 3), "sha256" (formats 1 and 2)."""
        return SHARD_HASHES[self.format_version]

    @property
    def transform(self) -> str:
        return self.compression.get("transform", "none")

    @property
    def quant(self) -> dict[str, Any] | None:
        """The quantization scheme (bits, group_size, exact_tokens, [recent_tokens,] scale_dtype, axes), None if lossless."""
        return self.compression.get("quant")

    @property
    def storage(self) -> str:
        """'lossless', '8-bit' or '4-bit'."""
        return f"{self.quant['bits']}-bit" if self.quant else "lossless"

    @property
    def document_tokens(self) -> int:
        """The framed document's tokens: the cache's, or every section's of a sectioned cache (with the head)."""
        return self.sections.document_tokens if self.sections is not None else self.num_tokens

    @property
    def bytes_raw(self) -> int:
        return sum(layer.raw_bytes for layer in self.layers + (self.sections.layers if self.sections else []))

    @property
    def bytes_stored(self) -> int:
        return sum(layer.stored_bytes for layer in self.layers + (self.sections.layers if self.sections else []))

    def to_json(self) -> dict[str, Any]:
        body = {"format": FORMAT_NAME, **asdict(self)}
        for key in ("provenance", "base", "sections"):
            if body[key] is None:
                del body[key]  # an older manifest re-serialised keeps its checksum
        body["layers"] = [layer.to_json(self.shard_hash) for layer in self.layers]
        if self.sections is not None:
            body["sections"] = self.sections.to_json(self.shard_hash)
        body["manifest_sha256"] = checksum(body)
        return body

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode() + b"\n"


def checksum(body: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of everything but the checksum field itself."""
    rest = {k: v for k, v in body.items() if k != "manifest_sha256"}
    canon = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def parse(raw: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; raise CacheCorruptError / CacheVersionError naming `where`.

    Every field kvcli reads is checked for type and range, and the fields are checked against each
    other (layer count, shapes vs token count vs byte counts), before any shard is touched.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, huge int literals
        raise bad(where, f"manifest is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(body, dict):
        raise bad(where, "manifest is not a JSON object")
    if body.get("format") != FORMAT_NAME:
        raise bad(where, "not a kvcli cache manifest")
    version = body.get("format_version")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise CacheVersionError(f"{where}: cache format version {version!r} is not supported "
                                f"(this kvcli reads {', '.join(map(str, SUPPORTED_VERSIONS))})")
    try:
        intact = body.get("manifest_sha256") == checksum(body)
    except (ValueError, TypeError, RecursionError):
        intact = False
    if not intact:
        raise bad(where, "manifest checksum does not match its content (edited or damaged)")
    try:
        return _validate(body, version, where)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as exc:
        # Defence in depth: a check should have named the problem already; a crafted manifest never crashes kvcli.
        raise bad(where, f"manifest does not follow the schema ({exc.__class__.__name__})") from None


def _validate(body: dict, version: int, where: str) -> Manifest:
    unknown = sorted(set(body) - _TOP_KEYS)
    if unknown:
        raise bad(where, f"unknown manifest field {unknown[0]!r}")
    for key in ("kvcli_version", "transformers_version", "created"):
        str_field(body, key, where)
    for key in ("model", "framing", "document", "compression"):
        get_field(body, key, dict, where)
    model = body["model"]
    dtype = str_field(model, "model.dtype", where)
    if dtype not in DTYPE_SIZES:
        raise bad(where, f"unsupported dtype {dtype!r}")
    int_field(model, "model.num_layers", where, 1, MAX_LAYERS)
    int_field(model, "model.num_kv_heads", where, 1, MAX_KV_HEADS)
    int_field(model, "model.head_dim", where, 1, MAX_HEAD_DIM)
    max_positions = int_field(model, "model.max_positions", where, 1, 1 << 40, optional=True)
    for key in ("config_sha256", "weights_sha256", "tokenizer_sha256"):
        str_field(model, f"model.{key}", where, pattern=_SHA256)
    str_field(model, "model.chat_template_sha256", where, pattern=_SHA256, optional=True)
    str_field(model, "model.model_type", where)
    str_field(model, "model.name", where, optional=True)
    _source(get_field(model, "model.source", dict, where), where)
    framing = body["framing"]
    if str_field(framing, "framing.kind", where) not in ("chat", "plain"):
        raise bad(where, "unknown prompt framing")
    str_field(framing, "framing.system", where, optional=True, limit=None)  # prompt text: any characters (shown with repr)
    int_field(framing, "framing.version", where, 0, 1 << 20, optional=True)
    str_field(framing, "framing.template_sha256", where, pattern=_SHA256, optional=True)
    _framing_cut(framing, len(get_field(body, "token_ids", list, where)), where)
    document = body["document"]
    document_record(document, where)
    compression = body["compression"]
    if compression.get("codec") != "zstd" or compression.get("transform", "none") not in ("none", "byteplane"):
        raise bad(where, "unknown compression")
    int_field(compression, "compression.level", where, -(1 << 17), 22, optional=True)
    quant = compression.get("quant")
    if version in (LOSSLESS_SHA256_VERSION, QUANT_SHA256_VERSION) and (quant is not None) != (version == QUANT_SHA256_VERSION):
        raise bad(where, f"format version {version} {'needs' if quant is None else 'has no'} a compression.quant block")
    if quant is not None:
        _quant(quant, compression, where)
    token_ids = get_field(body, "token_ids", list, where)
    if not token_ids or any(type(t) is not int or not 0 <= t < (1 << 31) for t in token_ids):
        raise bad(where, "token_ids must be a non-empty list of non-negative integers")
    if len(token_ids) > MAX_TOKENS or (max_positions is not None and len(token_ids) > max_positions):
        raise bad(where, f"{len(token_ids)} tokens exceed the model's limit of {max_positions or MAX_TOKENS} positions")
    layers_raw = get_field(body, "layers", list, where)
    if len(layers_raw) != model["num_layers"]:
        raise bad(where, f"{len(layers_raw)} layers listed, model has {model['num_layers']}")
    base = chain.check_base(body, len(token_ids), version == FORMAT_VERSION, where)
    layers = [_layer(entry, i, len(token_ids), base["num_tokens"] if base else 0, model, where, quant, SHARD_HASHES[version])
              for i, entry in enumerate(layers_raw)]
    provenance = _provenance(body, where)
    sections = sec.check(body, version, model, len(token_ids), quant, SHARD_HASHES[version], where, _layer)
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
        provenance=provenance,
        base=base,
        sections=sections,
    )


def _framing_cut(framing: dict, num_tokens: int, where: str) -> None:
    """Framing version 2 moves the cut (engine/prompt/framing.py): document text re-tokenized with each question.
    Its three fields come together, with version 2 only, and say something (a cut that cuts nothing is not)."""
    keys = ("anchor", "anchor_tokens", "pending")
    present = [k for k in keys if k in framing]
    if framing.get("version") != FRAMING_VERSION_CUT:
        if present:
            raise bad(where, f"manifest field 'framing.{present[0]}' belongs to framing version 2")
        return
    anchor = str_field(framing, "framing.anchor", where, limit=None)
    pending = str_field(framing, "framing.pending", where, limit=None)
    tokens = int_field(framing, "framing.anchor_tokens", where, 0, min(num_tokens - 1, 1 << 10))
    if not (tokens or pending) or bool(tokens) != bool(anchor):
        raise bad(where, "framing version 2 without a consistent cut (anchor, anchor_tokens, pending)")


def _provenance(body: dict, where: str) -> dict[str, str] | None:
    """The optional provenance object: known keys only, each a short plain string."""
    prov = get_field(body, "provenance", dict, where, optional=True)
    if prov is None:
        return None
    unknown = sorted(set(prov) - set(PROVENANCE_KEYS))
    if unknown:
        raise bad(where, f"unknown provenance field {unknown[0]!r}")
    for key in PROVENANCE_KEYS:
        str_field(prov, f"provenance.{key}", where, optional=True)
    return dict(prov)


def _quant(quant: Any, compression: dict, where: str) -> None:
    """The quantization block: exactly these fields, each in range (sizes and layout follow from it)."""
    if not isinstance(quant, dict):
        raise bad(where, "manifest field 'compression.quant' has the wrong type")
    if not _QUANT_KEYS <= set(quant) <= _QUANT_KEYS | _QUANT_OPTIONAL:
        raise bad(where, f"compression.quant fields {sorted(quant)} are not {sorted(_QUANT_KEYS)} "
                          f"(plus optionally {sorted(_QUANT_OPTIONAL)})")
    if int_field(quant, "compression.quant.bits", where, 1, 64) not in KV_BITS:
        raise bad(where, f"unsupported quantization to {quant['bits']} bits")
    int_field(quant, "compression.quant.group_size", where, 1, MAX_GROUP)
    int_field(quant, "compression.quant.exact_tokens", where, 0, MAX_TOKENS)
    if "recent_tokens" in quant:
        int_field(quant, "compression.quant.recent_tokens", where, 0, MAX_TOKENS)
    if str_field(quant, "compression.quant.scale_dtype", where) not in ("float16", "float32"):
        raise bad(where, "unsupported compression.quant.scale_dtype")
    for key, axis in QUANT_AXES.items():
        if quant[key] != axis:
            raise bad(where, f"compression.quant.{key} must be {axis!r}")
    if compression.get("transform", "none") != "none":
        raise bad(where, "a quantized cache has no byte-plane transform")


def _layer(entry: Any, i: int, num_tokens: int, base_tokens: int, model: dict, where: str, quant: dict | None,
           hash_name: str) -> LayerEntry:
    w = f"{where} (layer {i})"
    if not isinstance(entry, dict):
        raise bad(w, "layer entry is not an object")
    unknown = sorted(set(entry) - _LAYER_KEYS - {hash_name})
    if unknown:
        raise bad(w, f"unknown layer field {unknown[0]!r}")
    if int_field(entry, "index", w, 0, MAX_DIM) != i:
        raise bad(w, "layer index out of order")
    kind = str_field(entry, "kind", w)
    if kind not in LAYER_KINDS:
        raise bad(w, f"unknown layer kind {kind!r}")
    window = int_field(entry, "sliding_window", w, 1, 1 << 31, optional=True)
    if (kind == "sliding") != (window is not None):
        raise bad(w, "sliding_window must be given exactly for sliding layers")
    seq_length = int_field(entry, "seq_length", w, 0, 1 << 31)
    cached = int_field(entry, "cached_length", w, 0, 1 << 31)
    expect_cached = num_tokens - base_tokens if kind == "full" else min(num_tokens, window - 1)  # a link: its own tokens
    if seq_length != num_tokens or cached != expect_cached:
        raise bad(w, f"lengths {cached}/{seq_length} do not fit {num_tokens} cached tokens" + (f" ({base_tokens} in its base)" * bool(base_tokens)))
    name = get_field(entry, "file", str, w)
    if not _SHARD_NAME.fullmatch(name) or name != shard_name(i):  # never a path: no '/', no '..', one name per layer
        raise bad(w, f"shard name {name!r} is not the plain file name {shard_name(i)!r}")
    key_shape, value_shape = shape_field(entry, "key_shape", w), shape_field(entry, "value_shape", w)
    for shape in (key_shape, value_shape):
        if shape[0] != 1 or shape[1] != model["num_kv_heads"] or shape[2] != cached:
            raise bad(w, f"shape {list(shape)} does not fit the model and {cached} tokens")
    if key_shape[3] != model["head_dim"]:
        raise bad(w, f"key head_dim {key_shape[3]} does not match the model's {model['head_dim']}")
    if not 1 <= value_shape[3] <= MAX_HEAD_DIM:
        raise bad(w, f"value head_dim {value_shape[3]} is out of range")
    item = DTYPE_SIZES[model["dtype"]]
    raw = item * (numel(key_shape) + numel(value_shape))
    if int_field(entry, "raw_bytes", w, 0, 1 << 48) != raw:
        raise bad(w, f"raw_bytes does not match shapes ({raw})")
    decoded = int_field(entry, "decoded_bytes", w, 0, 1 << 48)
    data = raw if quant is None else payload.data_bytes(payload.quant_layout(model["dtype"], key_shape, value_shape, quant))
    if not data < decoded <= data + 8 + payload.MAX_HEADER:
        raise bad(w, "decoded_bytes does not fit the shapes")
    stored = int_field(entry, "stored_bytes", w, 1, 1 << 48)
    if stored > decoded + decoded // 64 + 4096:  # zstd never expands data by more than a sliver
        raise bad(w, "stored_bytes does not fit decoded_bytes")
    str_field(entry, hash_name, w, pattern=_HEX256)  # both hashes give 32 bytes
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
        digest=entry[hash_name],
    )
