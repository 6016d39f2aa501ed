"""The fuzz catalogue and its worker process (tests/format/test_fuzz.py runs it): every mutation of a small cache with
what it must give, the crafted shard payloads, seeded random cases, and the worker that runs each through
`kvcli verify` and `kvcli ask` under an address-space cap and an audit hook. Run by path, it is the worker."""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import shutil
import stat
import struct
import sys
import time
from pathlib import Path


from kvcli.format import manifest as mf, store

SEED = int(os.environ.get("KVCLI_FUZZ_SEED", "20250607"))
RANDOM_SECONDS = float(os.environ.get("KVCLI_FUZZ_SECONDS", "10"))
MAX_RANDOM_CASES = 1500
QUESTION = "What is this document about?"
AS_HEADROOM = 1 << 30  # address space allowed above a warmed-up ask: a crafted cache gets no more
RSS_GROWTH_LIMIT = 300 << 20
REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- helpers shared by worker and tests


DIGEST = mf.SHARD_HASHES[mf.FORMAT_VERSION]  # the layer key of a shard's digest in the caches kvcli writes


def sha(data: bytes) -> str:
    """A shard's digest as the manifests kvcli writes hold it."""
    return store.shard_digest(data, DIGEST)


def load_body(cache: Path) -> dict:
    return json.loads((cache / "manifest.json").read_bytes())


def save_body(cache: Path, body: dict, *, fix: bool = True) -> None:
    from kvcli.format import manifest as mf

    if fix:
        body["manifest_sha256"] = mf.checksum(body)
    path = cache / "manifest.json"
    path.unlink()
    path.write_text(json.dumps(body, indent=1, sort_keys=True))


def split_payload(payload: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", payload[:8])
    return json.loads(payload[8 : 8 + n]), payload[8 + n :]


def join_payload(header, body: bytes, *, length: int | None = None) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head) if length is None else length) + head + body


def zstd(payload: bytes, *, declare: bool = True) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=1, write_content_size=declare).compress(payload)


def forged_frame(declared: int) -> bytes:
    """A 16-byte zstd frame that declares `declared` content bytes (one RLE block of 16 zero bytes)."""
    fhd = 0b11100000  # 8-byte content size, single segment, no checksum, no dictionary
    block = (16 << 3) | (1 << 1) | 1  # size 16, RLE, last block
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + struct.pack("<Q", declared) + block.to_bytes(3, "little") + b"\x00"


def crafted_shards(stored: bytes, raw_bytes: int) -> list[tuple[str, bytes, int | None]]:
    """Damaged shard contents for one layer: (label, bytes, decoded_bytes to record or None to keep).

    Every one must be refused by codec.decode_layer even when the manifest's sha256 matches it.
    """
    import zstandard

    payload = zstandard.ZstdDecompressor().decompress(stored)
    header, body = split_payload(payload)
    data_bytes = len(body)  # the tensors' bytes: raw_bytes for a lossless shard, the quantized layout's otherwise
    out: list[tuple[str, bytes, int | None]] = []

    def add(label: str, new_payload: bytes, *, declare: bool = True, record: bool = True) -> None:
        size = len(new_payload)
        fits = data_bytes < size <= data_bytes + 8 + 64 * 1024
        out.append((label, zstd(new_payload, declare=declare), size if record and fits else None))

    def with_header(label: str, edit, data: bytes = body) -> None:
        h = copy.deepcopy(header)
        edit(h)
        add(label, join_payload(h, data))

    # decompression bounds
    out.append(("bomb: frame declares 1 TiB", forged_frame(1 << 40), None))
    out.append(("bomb: 64 MiB of zeros, size declared", zstd(bytes(64 << 20)), None))
    out.append(("bomb: 64 MiB of zeros, size not declared", zstd(bytes(64 << 20), declare=False), None))
    add("payload 8 bytes longer (size declared)", payload + bytes(8), record=False)
    add("payload 8 bytes longer (undeclared)", payload + bytes(8), declare=False, record=False)
    add("payload 8 bytes shorter (size declared)", payload[:-8], record=False)
    add("payload 8 bytes shorter (undeclared)", payload[:-8], declare=False, record=False)
    add("trailing bytes after the tensors", payload + bytes(8))
    out.append(("two frames", zstd(payload[:1000]) + zstd(payload[1000:]), None))
    out.append(("frame then garbage", stored + b"garbage!", None))
    out.append(("frame then a second frame", stored + zstd(b"x"), None))
    out.append(("skippable frame first", b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"abcd" + stored, None))
    out.append(("not zstd: random bytes", random.Random(7).randbytes(len(stored)), None))
    out.append(("not zstd: raw safetensors", payload, None))
    out.append(("not zstd: gzip", __import__("gzip").compress(payload), None))
    out.append(("not zstd: 3 bytes", b"\x28\xb5\x2f", None))
    if "keys.codes" in header:
        _quant_lies(header, body, with_header, add)
        return out
    keys = header["keys"]
    nk = keys["data_offsets"][1]
    # safetensors header lies
    with_header("keys dtype F32 (byteplane wants U8)", lambda h: h["keys"].update(dtype="F32"))
    with_header("values dtype F16", lambda h: h["values"].update(dtype="F16"))
    with_header("keys shape +1", lambda h: h["keys"].update(shape=[h["keys"]["shape"][0], h["keys"]["shape"][1] + 1]))
    with_header("keys shape as strings", lambda h: h["keys"].update(shape=[str(s) for s in h["keys"]["shape"]]))
    with_header("keys shape 3-d", lambda h: h["keys"].update(shape=[1, *h["keys"]["shape"]]))
    with_header("keys shape huge", lambda h: h["keys"].update(shape=[4, 1 << 40]))
    with_header("keys offsets short", lambda h: h["keys"].update(data_offsets=[0, nk - 1]))
    with_header("keys offsets shifted", lambda h: h["keys"].update(data_offsets=[1, nk + 1]))
    with_header("keys offsets negative", lambda h: h["keys"].update(data_offsets=[-8, nk - 8]))
    with_header("keys offsets strings", lambda h: h["keys"].update(data_offsets=["0", str(nk)]))
    with_header("keys offsets floats", lambda h: h["keys"].update(data_offsets=[0.0, float(nk)]))
    with_header("keys offsets bools", lambda h: h["keys"].update(data_offsets=[False, nk]))
    with_header("keys offsets one number", lambda h: h["keys"].update(data_offsets=[0]))
    with_header("keys offsets three numbers", lambda h: h["keys"].update(data_offsets=[0, nk, nk]))
    with_header("keys offsets null", lambda h: h["keys"].update(data_offsets=None))
    with_header("keys offsets huge", lambda h: h["keys"].update(data_offsets=[0, 1 << 62]))
    with_header("keys offsets missing", lambda h: h["keys"].pop("data_offsets"))
    with_header("values overlap keys", lambda h: h["values"].update(data_offsets=list(h["keys"]["data_offsets"])))
    with_header("tensors swapped", lambda h: h.update(keys=h["values"], values=h["keys"]))
    with_header("transform none in shard", lambda h: h["__metadata__"].update(transform="none"))
    with_header("dtype float16 in shard", lambda h: h["__metadata__"].update(dtype="float16"))
    with_header("metadata a list", lambda h: h.update(__metadata__=["transform"]))
    with_header("metadata a string", lambda h: h.update(__metadata__="byteplane"))
    with_header("extra tensor", lambda h: h.update(bias={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}))
    with_header("values missing", lambda h: h.pop("values"))
    with_header("keys not an object", lambda h: h.update(keys=[1, 2]))
    add("header length 2**63", join_payload(header, body, length=1 << 63))
    add("header length 0", join_payload(header, body, length=0))
    add("header length past the payload", join_payload(header, body, length=len(payload)))
    add("header length cuts the JSON", join_payload(header, body, length=16))
    add("header a JSON array", join_payload(b"[1, 2, 3]", body))
    add("header not UTF-8", join_payload(b'{"keys": "\xff\xfe"}', body))
    add("header nested 30000 deep", join_payload(b"[" * 30000 + b"]" * 30000, body))
    add("header with a 5000-digit number", join_payload(b'{"n": ' + b"7" * 5000 + b"}", body))
    add("header NaN offsets", join_payload(json.dumps({**header, "keys": {**keys, "data_offsets": [float("nan"), nk]}}).encode(), body))
    return out


def _quant_lies(header: dict, body: bytes, with_header, add) -> None:
    """Header and content lies for a quantized shard (keys.exact/recent/codes/scale/min, then values.*)."""
    codes = header["keys.codes"]
    nc = codes["data_offsets"]
    with_header("keys.codes dtype F32", lambda h: h["keys.codes"].update(dtype="F32"))
    with_header("keys.codes shape +1", lambda h: h["keys.codes"].update(shape=[h["keys.codes"]["shape"][0] + 1]))
    with_header("keys.codes shape 2-d", lambda h: h["keys.codes"].update(shape=[1, *h["keys.codes"]["shape"]]))
    with_header("keys.codes shape huge", lambda h: h["keys.codes"].update(shape=[1 << 40]))
    with_header("keys.codes offsets short", lambda h: h["keys.codes"].update(data_offsets=[nc[0], nc[1] - 1]))
    with_header("keys.codes offsets huge", lambda h: h["keys.codes"].update(data_offsets=[nc[0], 1 << 62]))
    with_header("keys.scale dtype F32 (F16 recorded)", lambda h: h["keys.scale"].update(dtype="F32"))
    with_header("values.min dtype BF16", lambda h: h["values.min"].update(dtype="BF16"))
    with_header("keys.scale shape +1", lambda h: h["keys.scale"].update(shape=[*h["keys.scale"]["shape"][:3], h["keys.scale"]["shape"][3] + 1]))
    with_header("keys.recent one token less", lambda h: h["keys.recent"].update(shape=[*h["keys.recent"]["shape"][:2], h["keys.recent"]["shape"][2] - 1, h["keys.recent"]["shape"][3]]))
    with_header("values.recent missing", lambda h: h.pop("values.recent"))
    with_header("exact and recent swapped", lambda h: h.update({"keys.exact": h["keys.recent"], "keys.recent": h["keys.exact"]}))
    with_header("keys.exact one more token", lambda h: h["keys.exact"].update(shape=[1, h["keys.exact"]["shape"][1], h["keys.exact"]["shape"][2] + 1, h["keys.exact"]["shape"][3]]))
    with_header("scale and min swapped", lambda h: h.update({"keys.scale": h["keys.min"], "keys.min": h["keys.scale"]}))
    with_header("keys and values parts swapped", lambda h: h.update({"keys.codes": h["values.codes"], "values.codes": h["keys.codes"]}))
    with_header("kv_bits 8 in a 4-bit shard", lambda h: h["__metadata__"].update(kv_bits="8"))
    with_header("kv_bits missing", lambda h: h["__metadata__"].pop("kv_bits"))
    with_header("kv_bits an int", lambda h: h["__metadata__"].update(kv_bits=4))
    with_header("transform byteplane in shard", lambda h: h["__metadata__"].update(transform="byteplane"))
    with_header("extra tensor keys.zero", lambda h: h.update({"keys.zero": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}))
    with_header("values.min missing", lambda h: h.pop("values.min"))
    with_header("plain keys instead of parts", lambda h: h.update(keys=h.pop("keys.codes")))
    for part in ("keys.scale", "values.min"):  # non-finite scales or minimums: the sha256 matches, the values do not
        begin, end = header[part]["data_offsets"]
        for label, fill in (("NaN", b"\xff\x7f"), ("inf", b"\x00\x7c")):
            junk = body[:begin] + fill * ((end - begin) // 2) + body[end:]
            with_header(f"{part} all {label}", lambda h: None, junk)
        junk = body[:begin] + b"\x00\xfc" + body[begin + 2 :]  # one -inf among finite values
        with_header(f"{part} one -inf", lambda h: None, junk)


def kind_of(value) -> str:
    for t, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "list"), (dict, "dict")):
        if isinstance(value, t):
            return name
    return "none"


def get_at(body, path):
    for p in path:
        body = body[p]
    return body


def set_at(body, path, value) -> None:
    get_at(body, path[:-1])[path[-1]] = value


def del_at(body, path) -> None:
    del get_at(body, path[:-1])[path[-1]]


# (path, kinds that are valid) for every field kvcli reads; layer fields are checked on the first and last layer
FIELDS: list[tuple[tuple, set[str]]] = [
    (("format",), {"str"}), (("format_version",), {"int"}), (("created",), {"str"}), (("kvcli_version",), {"str"}),
    (("transformers_version",), {"str"}), (("token_ids",), {"list"}), (("token_ids", 0), {"int"}), (("layers",), {"list"}),
    (("model",), {"dict"}), (("model", "dtype"), {"str"}), (("model", "num_layers"), {"int"}),
    (("model", "num_kv_heads"), {"int"}), (("model", "head_dim"), {"int"}), (("model", "max_positions"), {"int", "none"}),
    (("model", "config_sha256"), {"str"}), (("model", "weights_sha256"), {"str"}), (("model", "tokenizer_sha256"), {"str"}),
    (("model", "chat_template_sha256"), {"str", "none"}), (("model", "model_type"), {"str"}), (("model", "name"), {"str", "none"}),
    (("model", "source"), {"dict"}), (("model", "source", "kind"), {"str"}), (("model", "source", "name"), {"str", "none"}),
    (("model", "source", "path"), {"str"}),
    (("framing",), {"dict"}), (("framing", "kind"), {"str"}), (("framing", "system"), {"str", "none"}),
    (("framing", "version"), {"int", "none"}), (("framing", "template_sha256"), {"str", "none"}),
    (("document",), {"dict"}), (("document", "sha256"), {"str"}), (("document", "chars"), {"int"}), (("document", "name"), {"str", "none"}),
    (("compression",), {"dict"}), (("compression", "codec"), {"str"}), (("compression", "level"), {"int", "none"}),
    (("compression", "transform"), {"str"}),
] + [
    (("layers", i, key), kinds)
    for i in (0, -1)
    for key, kinds in (
        ("index", {"int"}), ("kind", {"str"}), ("cached_length", {"int"}), ("seq_length", {"int"}), ("sliding_window", {"int", "none"}),
        ("file", {"str"}), ("key_shape", {"list"}), ("value_shape", {"list"}), ("raw_bytes", {"int"}), ("decoded_bytes", {"int"}),
        ("stored_bytes", {"int"}), (DIGEST, {"str"}),
    )
] + [(("layers", 0, "key_shape", d), {"int"}) for d in range(4)] + [(("layers", 0, "value_shape", 3), {"int"})]
QUANT_FIELDS: list[tuple[tuple, set[str]]] = [
    (("compression", "quant"), {"dict"}), (("compression", "quant", "bits"), {"int"}), (("compression", "quant", "group_size"), {"int"}),
    (("compression", "quant", "exact_tokens"), {"int"}), (("compression", "quant", "recent_tokens"), {"int"}),
    (("compression", "quant", "scale_dtype"), {"str"}),
    (("compression", "quant", "keys"), {"str"}), (("compression", "quant", "values"), {"str"}),
]
# never valid for a field of the kinds listed: a str "1" is fine for a str field, None for an optional one
CONFUSION = ["1", 1.5, True, False, None, [1], [[1, [2, [3]]]], {"a": 1}, float("nan"), float("-inf"), 10**30, -1]
OPTIONAL_DELETABLE = {("model", "max_positions"), ("model", "chat_template_sha256"), ("model", "name"), ("model", "source", "name"),
                      ("framing", "system"), ("framing", "version"), ("framing", "template_sha256"), ("document", "name"),
                      ("compression", "level"), ("layers", 0, "sliding_window"), ("layers", -1, "sliding_window")}


def confusion_values(path: tuple, kinds: set[str]) -> list:
    values = []
    for v in CONFUSION:
        k = kind_of(v)
        if (k == "str" and "str" in kinds) or (k == "none" and "none" in kinds):
            continue
        if path == ("compression", "level") and v == -1:  # negative zstd levels exist
            continue
        values.append(v)
    return values


# ---------------------------------------------------------------- the catalogue of mutations
# Each case: (label, expect, mutate(cache, ctx)). expect:
#   "bad"   exit 3 from verify and from ask;
#   "model" the cache is consistent but built for another model: ask exits 3, verify may pass;
#   "ok"    the change does not matter (formatting, extra information): exit 0 and the pristine answer.


def _recompute(edit):
    def mutate(cache, ctx):
        body = load_body(cache)
        edit(body)
        save_body(cache, body)

    return mutate


def _plain(edit):
    def mutate(cache, ctx):
        body = load_body(cache)
        edit(body)
        save_body(cache, body, fix=False)

    return mutate


def _file_bytes(name, edit):
    def mutate(cache, ctx):
        path = cache / name
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(edit(data))

    return mutate


def _flip(positions):
    def edit(data):
        b = bytearray(data)
        for p, bit in positions:
            b[p % len(b)] ^= 1 << bit
        return bytes(b)

    return edit


def resize_tokens(body, n: int, *, max_positions=None) -> None:
    """Make every count in the manifest agree with n tokens (shards untouched)."""
    ids = body["token_ids"]
    body["token_ids"] = (ids * (n // len(ids) + 1))[:n]
    if max_positions is not None:
        body["model"]["max_positions"] = max_positions
    for layer in body["layers"]:
        extra = layer["decoded_bytes"] - layer["raw_bytes"]
        layer["cached_length"] = layer["seq_length"] = n
        layer["key_shape"][2] = layer["value_shape"][2] = n
        item = {"float32": 4, "float16": 2, "bfloat16": 2}[body["model"]["dtype"]]
        layer["raw_bytes"] = item * sum(s[0] * s[1] * s[2] * s[3] for s in (layer["key_shape"], layer["value_shape"]))
        layer["decoded_bytes"] = layer["raw_bytes"] + extra


def _set_value_dim(body, dim: int) -> None:
    for layer in body["layers"]:
        extra = layer["decoded_bytes"] - layer["raw_bytes"]
        layer["value_shape"][3] = dim
        k, v = layer["key_shape"], layer["value_shape"]
        layer["raw_bytes"] = 4 * (k[0] * k[1] * k[2] * k[3] + v[0] * v[1] * v[2] * v[3])
        layer["decoded_bytes"] = layer["raw_bytes"] + extra


def _replace_with(kind: str, name: str, target: str | None = None):
    def mutate(cache, ctx):
        path = cache / name
        data = path.read_bytes()
        path.unlink()
        outside = cache.parent / "outside"
        outside.mkdir(exist_ok=True)
        if kind == "dir":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink-inside":
            path.symlink_to(target)
        elif kind == "symlink-outside":  # a byte-identical copy outside: following it would "verify"
            (outside / name).write_bytes(data)
            path.symlink_to(outside / name)
        elif kind == "symlink-relative-outside":
            (outside / name).write_bytes(data)
            path.symlink_to(Path("..") / "outside" / name)
        elif kind == "symlink-dev":
            path.symlink_to(target)
        elif kind == "hardlink-inside":
            os.link(cache / target, path)
        elif kind == "sparse-huge":
            with open(path, "wb") as f:
                f.truncate(65 * 1024 * 1024)
        elif kind == "socket":
            import socket

            here = os.getcwd()
            os.chdir(cache)  # socket paths are limited to ~100 bytes
            try:
                s = socket.socket(socket.AF_UNIX)
                s.bind(name)
                s.close()
            finally:
                os.chdir(here)

    return mutate


def _traversal(name_for):
    """Point layer 0 at another path; put a byte-identical copy of the shard there where possible."""

    def mutate(cache, ctx):
        body = load_body(cache)
        name = name_for(cache)
        shard = (cache / body["layers"][0]["file"]).read_bytes()
        target = cache / name
        if name and "\x00" not in name and str(target).startswith(str(cache.parent) + os.sep):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    target.write_bytes(shard)
            except OSError:
                pass
        body["layers"][0]["file"] = name
        save_body(cache, body)

    return mutate


def _crafted_shard(index: int, label: str):
    def mutate(cache, ctx):
        body = load_body(cache)
        layer = body["layers"][index]
        data, decoded = ctx["crafted"][index][label]
        (cache / layer["file"]).unlink()
        (cache / layer["file"]).write_bytes(data)
        layer["stored_bytes"] = len(data)
        layer[DIGEST] = sha(data)
        if decoded is not None:
            layer["decoded_bytes"] = decoded
        save_body(cache, body)

    return mutate


def _padded_header_shard(cache, ctx):
    """A valid shard written differently (8 more spaces of header padding): still the same tensors."""
    import zstandard

    body = load_body(cache)
    layer = body["layers"][0]
    payload = zstandard.ZstdDecompressor().decompress((cache / layer["file"]).read_bytes())
    header, rest = split_payload(payload)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8) + b" " * 8
    new = struct.pack("<Q", len(head)) + head + rest
    data = zstd(new)
    (cache / layer["file"]).unlink()
    (cache / layer["file"]).write_bytes(data)
    layer.update(stored_bytes=len(data), decoded_bytes=len(new), **{DIGEST: sha(data)})
    save_body(cache, body)


def catalogue(ctx) -> list[tuple[str, str, object]]:
    body0 = ctx["body"]
    n = len(body0["token_ids"])
    files = [layer["file"] for layer in body0["layers"]]
    mlen = ctx["manifest_len"]
    slen = ctx["shard_lens"]
    other_hex = "ab" * 32
    cases: list[tuple[str, str, object]] = []
    add = lambda label, expect, fn: cases.append((label, expect, fn))  # noqa: E731

    # -- bytes of the manifest and shards, no checksum fixing
    rng = random.Random(SEED)
    for k in range(12):
        pos = [(rng.randrange(mlen), rng.randrange(8)) for _ in range(rng.choice((1, 1, 2, 5)))]
        add(f"manifest bit flips {pos}", "bad", _file_bytes("manifest.json", _flip(pos)))
    for cut in (0, 1, 2, mlen // 2, mlen - 2):
        add(f"manifest truncated to {cut}", "bad", _file_bytes("manifest.json", lambda d, c=cut: d[:c]))
    add("manifest extended with junk", "bad", _file_bytes("manifest.json", lambda d: d + b"x"))
    add("manifest extended with a second object", "bad", _file_bytes("manifest.json", lambda d: d + b"{}"))
    add("manifest extended with whitespace", "ok", _file_bytes("manifest.json", lambda d: d + b"\n\n  \t\n"))
    add("manifest not UTF-8", "bad", _file_bytes("manifest.json", lambda d: b"\xff\xfe" + d))
    add("manifest UTF-8 BOM", "ok", _file_bytes("manifest.json", lambda d: b"\xef\xbb\xbf" + d))
    add("manifest empty object", "bad", _file_bytes("manifest.json", lambda d: b"{}"))
    add("manifest a list", "bad", _file_bytes("manifest.json", lambda d: b"[]"))
    add("manifest nested 100000 deep", "bad", _file_bytes("manifest.json", lambda d: b"[" * 100000 + b"]" * 100000))
    add("manifest with a 5000-digit number", "bad", _file_bytes("manifest.json", lambda d: d.replace(b'"format_version": 3', b'"format_version": ' + b"3" * 5000)))
    add("manifest re-indented", "ok", lambda c, x: save_body(c, load_body(c), fix=False) or (c / "manifest.json").write_text(json.dumps(load_body(c), indent=4)))
    add("manifest keys reordered", "ok", lambda c, x: (c / "manifest.json").write_text(json.dumps(dict(reversed(list(load_body(c).items()))))))
    for i, f in enumerate(files):
        for k in range(4):
            pos = [(rng.randrange(slen[i]), rng.randrange(8)) for _ in range(rng.choice((1, 3)))]
            add(f"{f} bit flips {pos}", "bad", _file_bytes(f, _flip(pos)))
        add(f"{f} first byte flipped", "bad", _file_bytes(f, _flip([(0, 0)])))
        add(f"{f} last byte flipped", "bad", _file_bytes(f, _flip([(slen[i] - 1, 7)])))
        for cut in (0, 1, slen[i] // 2, slen[i] - 1):
            add(f"{f} truncated to {cut}", "bad", _file_bytes(f, lambda d, c=cut: d[:c]))
        add(f"{f} extended by one zero byte", "bad", _file_bytes(f, lambda d: d + b"\0"))
        add(f"{f} extended by 1 MiB", "bad", _file_bytes(f, lambda d: d + bytes(1 << 20)))
        add(f"{f} zero-filled", "bad", _file_bytes(f, lambda d: bytes(len(d))))
    add("shards swapped", "bad", lambda c, x: [os.rename(c / files[0], c / "t"), os.rename(c / files[1], c / files[0]), os.rename(c / "t", c / files[1])])
    add("shard 0 removed", "bad", lambda c, x: (c / files[0]).unlink())
    add("last shard removed", "bad", lambda c, x: (c / files[-1]).unlink())
    add("manifest removed", "bad", lambda c, x: (c / "manifest.json").unlink())
    add("cache folder is a file", "bad", lambda c, x: shutil.rmtree(c) or c.write_bytes(b"not a cache"))
    add("cache folder empty", "bad", lambda c, x: shutil.rmtree(c) or c.mkdir())
    # -- file kinds: symlinks (in and out of the folder), FIFOs, devices, folders, hard links
    for kind, target in (("dir", None), ("fifo", None), ("symlink-inside", files[1]), ("symlink-outside", None),
                         ("symlink-relative-outside", None), ("symlink-dev", "/dev/zero"), ("hardlink-inside", files[1]),
                         ("sparse-huge", None), ("socket", None)):
        add(f"{files[0]} replaced by {kind}", "bad", _replace_with(kind, files[0], target))
    for kind, target in (("dir", None), ("fifo", None), ("symlink-outside", None), ("symlink-dev", "/dev/zero"),
                         ("symlink-dev", "/dev/urandom"), ("sparse-huge", None)):
        add(f"manifest.json replaced by {kind} {target or ''}", "bad", _replace_with(kind, "manifest.json", target))
    # -- plain edits (checksum not recomputed): the checksum catches them
    for path, _kinds in FIELDS:
        if path[-1] == "manifest_sha256":
            continue
        add(f"plain edit {path}", "bad", _plain(lambda b, p=path: set_at(b, p, ["edited", get_at(b, p)])))
    add("plain edit: checksum removed", "bad", _plain(lambda b: b.pop("manifest_sha256")))
    add("plain edit: checksum upper-case", "bad", _plain(lambda b: b.update(manifest_sha256=b["manifest_sha256"].upper())))
    add("plain edit: checksum an int", "bad", _plain(lambda b: b.update(manifest_sha256=1)))
    add("plain edit: token id + 1", "bad", _plain(lambda b: b["token_ids"].__setitem__(3, b["token_ids"][3] + 1)))
    add("plain edit: drop a layer", "bad", _plain(lambda b: b["layers"].pop()))
    # -- edits with the checksum recomputed: the schema and the consistency checks must catch them
    for path, kinds in FIELDS:
        for value in confusion_values(path, kinds):
            add(f"type confusion {path} = {value!r}", "bad", _recompute(lambda b, p=path, v=value: set_at(b, p, v)))
        if path not in OPTIONAL_DELETABLE and not isinstance(path[-1], int):
            add(f"missing {path}", "bad", _recompute(lambda b, p=path: del_at(b, p)))
    for key in ("created", "kvcli_version", "model_type", "name"):
        where = ("model", key) if key in ("model_type", "name") else (key,)
        add(f"control characters in {where}", "bad", _recompute(lambda b, w=where: set_at(b, w, "x\x1b]0;pwned\x07\x1b[31m")))
        add(f"overlong {where}", "bad", _recompute(lambda b, w=where: set_at(b, w, "x" * 5000)))
    add("control characters in document name", "bad", _recompute(lambda b: b["document"].update(name="a\x1b[2Jb")))
    add("control characters in source path", "bad", _recompute(lambda b: b["model"]["source"].update(path="/tmp/\x9b31m")))
    add("source kind hub without id", "bad", _recompute(lambda b: b["model"].update(source={"kind": "hub", "name": "x"})))
    add("source kind gguf without sha256", "bad", _recompute(lambda b: b["model"].update(source={"kind": "gguf", "name": "x", "path": "/x.gguf"})))
    add("unknown top-level field", "bad", _recompute(lambda b: b.update(evil={"exec": "rm -rf /"})))
    add("unknown layer field", "bad", _recompute(lambda b: b["layers"][0].update(pickle="gASVAAAAAAAAAAB9lC4=")))
    add("format name changed", "bad", _recompute(lambda b: b.update(format="kvcli-cache2")))
    add("format version 2", "bad", _recompute(lambda b: b.update(format_version=2)))
    add("format version 1.0", "bad", _recompute(lambda b: b.update(format_version=1.0)))
    add("format version true", "bad", _recompute(lambda b: b.update(format_version=True)))
    for field in ("cached_length", "seq_length", "raw_bytes", "decoded_bytes", "stored_bytes"):
        for delta in (-1, 1):
            add(f"layer 0 {field} {delta:+d}", "bad", _recompute(lambda b, f=field, d=delta: b["layers"][0].update({f: b["layers"][0][f] + d})))
    add("decoded_bytes below raw_bytes", "bad", _recompute(lambda b: b["layers"][0].update(decoded_bytes=b["layers"][0]["raw_bytes"])))
    add("decoded_bytes 1 MiB above raw_bytes", "bad", _recompute(lambda b: b["layers"][0].update(decoded_bytes=b["layers"][0]["raw_bytes"] + (1 << 20))))
    add("stored_bytes far above decoded_bytes", "bad", _recompute(lambda b: b["layers"][0].update(stored_bytes=1 << 40)))
    add("layer index 1 for layer 0", "bad", _recompute(lambda b: b["layers"][0].update(index=1)))
    add("layers reversed", "bad", _recompute(lambda b: b["layers"].reverse()))
    add("layer 0 twice", "bad", _recompute(lambda b: b["layers"].__setitem__(1, copy.deepcopy(b["layers"][0]))))
    add("layer kind sliding without window", "bad", _recompute(lambda b: b["layers"][0].update(kind="sliding")))
    add("layer kind sliding, window 10", "bad", _recompute(lambda b: b["layers"][0].update(kind="sliding", sliding_window=10)))
    add("layer kind full with a window", "bad", _recompute(lambda b: b["layers"][0].update(sliding_window=4096)))
    add("layer kind unknown", "bad", _recompute(lambda b: b["layers"][0].update(kind="linear")))
    add("num_layers + 1", "bad", _recompute(lambda b: b["model"].update(num_layers=b["model"]["num_layers"] + 1)))
    add("num_kv_heads + 1", "bad", _recompute(lambda b: b["model"].update(num_kv_heads=b["model"]["num_kv_heads"] + 1)))
    add("head_dim + 1", "bad", _recompute(lambda b: b["model"].update(head_dim=b["model"]["head_dim"] + 1)))
    add("max_positions below the token count", "bad", _recompute(lambda b: b["model"].update(max_positions=n - 1)))
    add("dtype float16 (byte counts now wrong)", "bad", _recompute(lambda b: b["model"].update(dtype="float16")))
    add("dtype float64", "bad", _recompute(lambda b: b["model"].update(dtype="float64")))
    add("dtype torch.float32", "bad", _recompute(lambda b: b["model"].update(dtype="torch.float32")))
    add("token ids one more", "bad", _recompute(lambda b: b["token_ids"].append(1)))
    add("token ids one fewer", "bad", _recompute(lambda b: b["token_ids"].pop()))
    add("token ids empty", "bad", _recompute(lambda b: b.update(token_ids=[])))
    add("token id 2**31", "bad", _recompute(lambda b: b["token_ids"].__setitem__(0, 1 << 31)))
    for d in range(4):
        add(f"key_shape[{d}] + 1", "bad", _recompute(lambda b, d=d: b["layers"][0]["key_shape"].__setitem__(d, b["layers"][0]["key_shape"][d] + 1)))
        add(f"key_shape[{d}] = 2**24", "bad", _recompute(lambda b, d=d: b["layers"][0]["key_shape"].__setitem__(d, 1 << 24)))
        add(f"key_shape[{d}] = 2**62", "bad", _recompute(lambda b, d=d: b["layers"][0]["key_shape"].__setitem__(d, 1 << 62)))
    add("key_shape 5-d", "bad", _recompute(lambda b: b["layers"][0]["key_shape"].append(1)))
    add("key_shape 3-d", "bad", _recompute(lambda b: b["layers"][0]["key_shape"].pop()))
    add("key_shape of floats", "bad", _recompute(lambda b: b["layers"][0].update(key_shape=[float(s) for s in b["layers"][0]["key_shape"]])))
    add("key_shape of strings", "bad", _recompute(lambda b: b["layers"][0].update(key_shape=[str(s) for s in b["layers"][0]["key_shape"]])))
    add("key_shape nested", "bad", _recompute(lambda b: b["layers"][0].update(key_shape=[[s] for s in b["layers"][0]["key_shape"]])))
    add("value_shape[3] + 1", "bad", _recompute(lambda b: b["layers"][0]["value_shape"].__setitem__(3, b["layers"][0]["value_shape"][3] + 1)))
    add("value head dim 2**24, byte counts consistent", "bad", _recompute(lambda b: _set_value_dim(b, 1 << 24)))
    add("value head dim 8192, byte counts consistent", "bad", _recompute(lambda b: _set_value_dim(b, 8192)))
    add("8000 tokens, counts consistent", "bad", _recompute(lambda b: resize_tokens(b, 8000)))
    add("100000 tokens over max_positions", "bad", _recompute(lambda b: resize_tokens(b, 100_000)))
    add("100000 tokens, max_positions raised", "bad", _recompute(lambda b: resize_tokens(b, 100_000, max_positions=10**6)))
    add("layer digest of another value", "bad", _recompute(lambda b: b["layers"][0].update({DIGEST: other_hex})))
    add("layer digest upper-case", "bad", _recompute(lambda b: b["layers"][0].update({DIGEST: b["layers"][0][DIGEST].upper()})))
    add("layer digest of the other shard", "bad", _recompute(lambda b: b["layers"][0].update({DIGEST: b["layers"][1][DIGEST]})))
    add("layer digest dropped", "bad", _recompute(lambda b: b["layers"][0].pop(DIGEST)))
    add("layer digest under the other hash's key", "bad",
        _recompute(lambda b: b["layers"][0].update(sha256=b["layers"][0].pop(DIGEST))))
    add("format version 1: its sha256 digests missing", "bad", _recompute(lambda b: b.update(format_version=1)))
    add("transform none", "bad", _recompute(lambda b: b["compression"].update(transform="none")))
    add("transform unknown", "bad", _recompute(lambda b: b["compression"].update(transform="shuffle")))
    add("codec zlib", "bad", _recompute(lambda b: b["compression"].update(codec="zlib")))
    add("compression level 99", "bad", _recompute(lambda b: b["compression"].update(level=99)))
    # path traversal and other names for layer 0 (a byte-identical copy waits at the relative targets)
    for name in ("../x.zst", "../outside/layer_000.safetensors.zst", "/etc/passwd", "/dev/zero", "a/b", "..", ".", "",
                 "./layer_000.safetensors.zst", "layer_000.safetensors.zst/", "layer_000.safetensors.zst/..",
                 "sub/layer_000.safetensors.zst", "layer_0000.safetensors.zst", "layer_1.safetensors.zst",
                 "layer_001.safetensors.zst", "LAYER_000.safetensors.zst", "layer_000.safetensors.zst\n",
                 "layer_000.safetensors.zst\x00", "layer_000.safetensors.zs\u0442", "manifest.json", "\\..\\x"):
        add(f"shard name {name!r}", "bad", _traversal(lambda c, nm=name: nm))
    add("shard name: absolute path of a copy outside", "bad", _traversal(lambda c: str(c.parent / "outside" / "abs.zst")))
    add("shard name: absolute path of the shard itself", "bad", _traversal(lambda c: str(c / "layer_000.safetensors.zst")))
    # crafted shard contents with sha256, stored_bytes (and decoded_bytes where it fits) recomputed
    for label in ctx["crafted"][0]:
        add(f"crafted shard 0: {label}", "bad", _crafted_shard(0, label))
    for label in list(ctx["crafted"][-1])[:6]:
        add(f"crafted last shard: {label}", "bad", _crafted_shard(-1, label))
    # consistent caches for another model: ask refuses them, verify may pass
    for key in ("config_sha256", "weights_sha256", "tokenizer_sha256"):
        add(f"model {key} of another model", "model", _recompute(lambda b, k=key: b["model"].update({k: other_hex})))
    add("model type gpt2", "model", _recompute(lambda b: b["model"].update(model_type="gpt2")))
    add("framing version 2", "model", _recompute(lambda b: b["framing"].update(version=2)))
    add("chat template of another model", "model", _recompute(lambda b: b["framing"].update(template_sha256=other_hex)))
    add("one layer model", "model", _recompute(lambda b: b["model"].update(num_layers=1) or b.update(layers=b["layers"][:1])))
    add("sliding layer, window above the token count", "model",
        _recompute(lambda b: b["layers"][0].update(kind="sliding", sliding_window=n + 5)))
    # changes that do not matter
    add("extra information in model", "ok", _recompute(lambda b: b["model"].update(note="hello")))
    add("document renamed", "ok", _recompute(lambda b: b["document"].update(name="other.txt")))
    add("created changed", "ok", _recompute(lambda b: b.update(created="2000-01-01T00:00:00+00:00")))
    add("optional fields removed", "ok", _recompute(lambda b: [b["model"].pop("name"), b["document"].pop("name"), b["compression"].pop("level")]))
    add("shard header padded (valid)", "ok", _padded_header_shard)
    return cases


def quant_catalogue(ctx) -> list[tuple[str, str, object]]:
    """The cases for a quantized (4-bit) cache: its own fields, schemes and payload layout, plus damage."""
    body0 = ctx["body"]
    files = [layer["file"] for layer in body0["layers"]]
    cases: list[tuple[str, str, object]] = []
    add = lambda label, expect, fn: cases.append((label, expect, fn))  # noqa: E731
    rng = random.Random(SEED + 3)
    for f in files:
        for k in range(3):
            pos = [(rng.randrange(ctx["shard_lens"][files.index(f)]), rng.randrange(8))]
            add(f"{f} bit flips {pos}", "bad", _file_bytes(f, _flip(pos)))
        add(f"{f} truncated by one byte", "bad", _file_bytes(f, lambda d: d[:-1]))
    for path, kinds in QUANT_FIELDS:
        for value in confusion_values(path, kinds):
            add(f"type confusion {path} = {value!r}", "bad", _recompute(lambda b, p=path, v=value: set_at(b, p, v)))
        add(f"missing {path}", "bad", _recompute(lambda b, p=path: del_at(b, p)))
        add(f"plain edit {path}", "bad", _plain(lambda b, p=path: set_at(b, p, ["edited", get_at(b, p)])))
    for key, values in (("bits", (8, 3, 2, 16, 0)), ("group_size", (32, 128, 1, 0, 1 << 17)), ("exact_tokens", (0, 3, 5, 1 << 30)),
                        ("recent_tokens", (0, 1, 1 << 30)),
                        ("scale_dtype", ("float32", "bfloat16", "float64")), ("keys", ("per_token", "")), ("values", ("per_channel",))):
        for v in values:
            add(f"quant {key} = {v!r}", "bad", _recompute(lambda b, k=key, v=v: b["compression"]["quant"].update({k: v})))
    add("quant block with an extra field", "bad", _recompute(lambda b: b["compression"]["quant"].update(zero_point=True)))
    add("format version 1 with a quant block", "bad", _recompute(lambda b: b.update(format_version=1)))
    add("format version 1, quant block dropped", "bad", _recompute(lambda b: b.update(format_version=1) or b["compression"].pop("quant")))
    add("format version 2: its sha256 digests missing", "bad", _recompute(lambda b: b.update(format_version=2)))
    add("format version 4", "bad", _recompute(lambda b: b.update(format_version=4)))
    add("transform byteplane", "bad", _recompute(lambda b: b["compression"].update(transform="byteplane")))
    add("decoded_bytes at raw_bytes", "bad", _recompute(lambda b: b["layers"][0].update(decoded_bytes=b["layers"][0]["raw_bytes"])))
    add("decoded_bytes 1 MiB above", "bad", _recompute(lambda b: b["layers"][0].update(decoded_bytes=b["layers"][0]["decoded_bytes"] + (1 << 20))))
    add("raw_bytes + 4", "bad", _recompute(lambda b: b["layers"][0].update(raw_bytes=b["layers"][0]["raw_bytes"] + 4)))
    for label in ctx["crafted"][0]:
        add(f"crafted shard 0: {label}", "bad", _crafted_shard(0, label))
    add("model weights_sha256 of another model", "model", _recompute(lambda b: b["model"].update(weights_sha256="ab" * 32)))
    add("document renamed", "ok", _recompute(lambda b: b["document"].update(name="other.txt")))
    add("shard header padded (valid)", "ok", _padded_header_shard)
    return cases


def random_junk(rng: random.Random, depth: int = 0):
    choice = rng.randrange(9 if depth < 3 else 6)
    if choice == 0:
        return rng.choice([-1, -(2**63), 2**63, 10**40, rng.randrange(-1000, 0)])
    if choice == 1:
        return rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf")])
    if choice == 2:
        return rng.choice([True, False, None])
    if choice == 3:
        alphabet = "ab/.\\\x00\x1b\x7f\u202e\ufeff\U0001f600 \n\"'"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
    if choice == 4:
        return "../" * rng.randrange(1, 5) + rng.choice(["etc/passwd", "x", "outside/layer_000.safetensors.zst"])
    if choice == 5:
        return rng.choice(["", "1", "0" * 64, "g" * 64])
    if choice == 6:
        return [random_junk(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if choice == 7:
        return {rng.choice(["a", "keys", "__proto__", ""]): random_junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    return [[[[[[1]]]]]]


def random_case(rng: random.Random, ctx) -> tuple[str, str, object]:
    files = [layer["file"] for layer in ctx["body"]["layers"]]
    kind = rng.randrange(5)
    if kind == 0:  # overwrite random bytes of a shard
        f = rng.choice(files)
        size = ctx["shard_lens"][files.index(f)]
        at, length = rng.randrange(size), rng.randrange(1, 64)
        junk = rng.randbytes(length)
        return f"random bytes at {at} of {f}", "bad", _file_bytes(f, lambda d: d[:at] + junk + d[at + length :] if d[at : at + length] != junk else d[:at] + bytes([d[at] ^ 1]) + d[at + 1 :])
    if kind == 1:  # overwrite random bytes of the manifest: bad unless the JSON content is unchanged
        at, length = rng.randrange(ctx["manifest_len"]), rng.randrange(1, 16)
        junk = rng.randbytes(length)
        return f"random bytes at {at} of manifest.json", "bad-unless-same", _file_bytes("manifest.json", lambda d: d[:at] + junk + d[at + length :])
    if kind == 2:  # cut or extend a random file
        f = rng.choice(files + ["manifest.json"])
        cut = rng.randrange(-200, 200) or 1
        junk = rng.randbytes(max(cut, 0))
        expect = "bad-unless-same" if f == "manifest.json" else "bad"
        return f"{f} resized by {cut}", expect, _file_bytes(f, lambda d: d[:cut] if cut < 0 else d + junk)
    if kind == 3:  # a random value of a wrong kind or range in a known field, checksum recomputed
        path, kinds = rng.choice(FIELDS + (QUANT_FIELDS if "quant" in ctx["body"]["compression"] else []))
        for _ in range(20):
            value = random_junk(rng)
            k = kind_of(value)
            if (k == "str" and "str" in kinds) or (k == "none" and "none" in kinds):
                continue
            if path == ("compression", "level") and k == "int" and -(1 << 17) <= value <= 22:
                continue
            break
        else:
            value = 1.5  # never valid anywhere
        return f"random {path} = {value!r}", "bad", _recompute(lambda b: set_at(b, path, value))
    labels = list(ctx["crafted"][0])
    return f"crafted shard 0: {(label := rng.choice(labels))}", "bad", _crafted_shard(0, label)


# ---------------------------------------------------------------- the worker process


def _snapshot(folder: Path) -> list:
    """Names, kinds, sizes and content hashes of everything under folder (FIFOs are never opened)."""
    out = []
    for root, dirs, names in os.walk(folder):
        for name in sorted(dirs + names):
            p = Path(root) / name
            st = os.lstat(p)
            digest = sha(p.read_bytes()) if stat.S_ISREG(st.st_mode) and st.st_size < (8 << 20) else None
            out.append((str(p.relative_to(folder)), stat.S_IFMT(st.st_mode), st.st_size, digest))
    return sorted(out)


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def _worker(cfg: dict) -> int:
    import threading

    import typer
    from click.testing import CliRunner

    import kvcli.engine.model.models as models
    from kvcli.cli import app

    command = typer.main.get_command(app)  # built once: typer's runner rebuilds it on every call (20 ms)

    scratch, pristine, model_dir = Path(cfg["scratch"]), Path(cfg["pristine"]), cfg["model"]
    real_load, loaded = models.load, {}

    def load(*args, **kwargs):  # every case asks with the same model: load it once
        key = json.dumps([args, {k: v for k, v in kwargs.items() if k != "progress"}], sort_keys=True, default=str)
        if key not in loaded:
            loaded[key] = real_load(*args, **kwargs)
        return loaded[key]

    models.load = load
    runner = CliRunner()

    in_cli = [False]

    def cli(*args):
        in_cli[0] = True
        try:
            r = runner.invoke(command, [str(a) for a in args], prog_name="kvcli")
        finally:
            in_cli[0] = False
        return {"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}

    def ask(path):
        return cli("ask", "--model", model_dir, "--cache", path, QUESTION, "--max-new-tokens", "6")

    reference = ask(pristine)
    assert reference["code"] == 0, reference
    assert cli("verify", pristine)["code"] == 0

    ctx = {"body": load_body(pristine), "manifest_len": (pristine / "manifest.json").stat().st_size}
    ctx["shard_lens"] = [(pristine / layer["file"]).stat().st_size for layer in ctx["body"]["layers"]]
    ctx["crafted"] = {}
    for index in (0, -1):
        layer = ctx["body"]["layers"][index]
        ctx["crafted"][index] = {label: (data, dec) for label, data, dec in crafted_shards((pristine / layer["file"]).read_bytes(), layer["raw_bytes"])}
    cases = quant_catalogue(ctx) if cfg.get("quant") else catalogue(ctx)

    # From here on: bounded address space, and every write-like operation and unpickling is recorded.
    violations: list[str] = []
    allowed = str(scratch.resolve()) + os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {"os.remove", "os.rename", "os.replace", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.symlink", "os.link",
                   "os.truncate", "os.chmod", "os.chown", "os.utime", "shutil.copyfile", "shutil.move"}

    def outside(p) -> bool:
        if isinstance(p, int):
            return False
        p = os.path.abspath(os.fsdecode(p))
        return not (p + os.sep).startswith(allowed) and p not in ("/dev/null",)

    def hook(event, args):
        if event == "pickle.find_class":
            violations.append(f"{event} {args!r}")
        if not in_cli[0]:  # the test's own mutations are not kvcli's doing
            return
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & write_flags)
            if writing and outside(path):
                violations.append(f"{event} {path!r} {mode!r} {flags!r}")
        elif event in path_events:
            written = args[1:2] if event in ("os.symlink", "os.link") else args[:2]  # a link's target is not written
            if any(outside(a) for a in written if isinstance(a, (str, bytes, os.PathLike))):
                violations.append(f"{event} {args!r}")

    import pickle

    import torch

    def refuse(name):
        def call(*args, **kwargs):
            violations.append(name)
            raise RuntimeError(f"{name} called")

        return call

    torch.load = refuse("torch.load")
    pickle.load, pickle.loads = refuse("pickle.load"), refuse("pickle.loads")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + AS_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sys.addaudithook(hook)

    results = []
    deadline = None
    rng = random.Random(SEED + 1)
    started = time.monotonic()
    n = 0
    while True:
        if n < len(cases):
            label, expect, mutate = cases[n]
        else:
            deadline = deadline or time.monotonic() + RANDOM_SECONDS
            if time.monotonic() > deadline or n >= len(cases) + MAX_RANDOM_CASES:
                break
            label, expect, mutate = random_case(rng, ctx)
        case_dir = scratch / f"case{n:04d}"
        case_dir.mkdir()
        cache = case_dir / "x.kv"
        shutil.copytree(pristine, cache)
        record = {"n": n, "label": label, "expect": expect, "cache": str(cache)}
        try:
            mutate(cache, ctx)
        except Exception as exc:  # a broken mutation is a bug in this test, reported as such
            record["mutate_error"] = f"{exc.__class__.__name__}: {exc}"
        if expect == "bad-unless-same":
            try:
                same = json.loads((cache / "manifest.json").read_bytes()) == ctx["body"]
            except Exception:
                same = False
            record["expect"] = "ok" if same else "bad"
        before = _snapshot(case_dir)
        t0 = time.monotonic()
        # a FIFO must never block a reader: run each command under a watchdog
        timer = threading.Timer(20, lambda: os._exit(99))
        timer.start()
        try:
            record["verify"] = cli("verify", cache)
            record["ask"] = ask(cache)
        finally:
            timer.cancel()
        record["seconds"] = round(time.monotonic() - t0, 3)
        record["changed"] = before != _snapshot(case_dir)
        results.append(record)
        shutil.rmtree(case_dir, ignore_errors=True)
        n += 1
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary = {
        "reference": reference["stdout"], "results": results, "violations": violations[:50],
        "rss_before": rss_before, "rss_after": rss_after, "as_limit": limit, "seconds": round(time.monotonic() - started, 1),
    }
    (scratch / "results.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(json.loads(sys.argv[1])))
