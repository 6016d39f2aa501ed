"""A GGUF file's config and tokenizer read from its header once (engine/model/gguf_config.py): the same config and
tokenizer as transformers' own GGUF reading (AutoConfig, AutoTokenizer with gguf_file), without gguf-py's reader;
files it leaves to transformers still load; the file's sha256 is remembered by its identity."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest

from kvcli.engine.model import digest, gguf_config, models
from kvcli.engine.model.gguf_file import Strings, read_header
from kvcli.format.identity import config_sha256, template_sha256, tokenizer_sha256


def _header_only_gguf(path: Path, arch: str, pre: str | None = None) -> Path:
    """A GGUF of `arch` with no tensors: a small model's fields and the default model's tokenizer (its vocabulary,
    merges, template), the tokenizer's pre-split named `pre` when given."""
    default = gguf.GGUFReader(str(models.default_gguf_path()))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, field in default.fields.items():
        if key.startswith("tokenizer.") and not (pre and key == "tokenizer.ggml.pre"):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    base = tmp_path_factory.mktemp("gguf-config")
    qwen = base / "qwen"
    qwen.mkdir()
    return [models.default_gguf_path(), _header_only_gguf(qwen / "tiny-qwen2.gguf", "qwen2", pre="qwen2")]


def _transformers(path: Path):
    from transformers import AutoConfig, AutoTokenizer

    return (AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name),
            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


def test_the_header_gives_transformers_config_and_tokenizer_without_gguf_py(files, monkeypatch):
    want = [_transformers(p) for p in files]

    def refused(*args, **kwargs):
        raise AssertionError("gguf-py's reader was used")

    monkeypatch.setattr(gguf.GGUFReader, "__init__", refused)
    for path, (config, tok) in zip(files, want):
        got = gguf_config.read(path)
        assert got is not None, path
        assert config_sha256(got[0]) == config_sha256(config), path
        assert got[0].to_dict()["vocab_size"] == config.vocab_size
        assert type(got[1]) is type(tok) and tokenizer_sha256(got[1]) == tokenizer_sha256(tok), path
        assert template_sha256(got[1].chat_template) == template_sha256(tok.chat_template) is not None
        text = "Licensor: Ünïcode 12,345 tokens\n  def f(x):"
        assert got[1](text)["input_ids"] == tok(text)["input_ids"]


def test_the_header_keeps_arrays_of_strings_as_their_length(files):
    header = read_header(files[0])
    tokens = header.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, Strings) and tokens.count == gguf_config.config_dict(header)["vocab_size"]
    assert isinstance(header.fields["tokenizer.ggml.token_type"], tuple)


def test_a_file_left_to_transformers_still_loads_its_config_and_tokenizer(files, tmp_path):
    path = tmp_path / files[1].name
    shutil.copy(files[1], path)
    (tmp_path / "tokenizer_config.json").write_text("{}")  # AutoTokenizer would read it: not told the type here
    assert gguf_config.read(path) is None
    source = {"kind": "gguf", "name": path.name, "path": str(path), "sha256": digest.sha256_file(path)}
    config, tok = models.config_and_tokenizer(source)
    want = _transformers(path)
    assert config_sha256(config) == config_sha256(want[0]) and tokenizer_sha256(tok) == tokenizer_sha256(want[1])
    assert (models.gguf_folders(source["sha256"])[1] / "config.json").is_file()  # kept for the next load


def test_a_files_sha256_is_remembered_by_its_identity(tmp_path, monkeypatch):
    path = tmp_path / "f.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    reads = []
    monkeypatch.setattr(digest, "sha256_file", lambda p: reads.append(p) or "a" * 64)
    ran = []
    assert digest.cached_sha(path, beside=lambda: ran.append(1)) == "a" * 64 and ran == [1]
    assert digest.cached_sha(path, beside=lambda: ran.append(2)) == "a" * 64 and ran == [1]  # remembered: no thread
    assert len(reads) == 1
    path.write_bytes(b"GGUF" + bytes(101))  # another size: hashed again
    assert digest.cached_sha(path) == "a" * 64 and len(reads) == 2
