"""A GGUF file's own low-bit weights (`weights="gguf"`), loaded straight from the mapped file.

The transformers model is built without weights (on the meta device); every linear layer and the token embedding
become the kernels package's PackedLinear / PackedEmbedding on the tensor's own blocks, one tensor at a time, and
only the small tensors (norms, biases) are materialised, with the values transformers' GGUF loading gives them (its
tensor processor, which also says how a tensor's rows are ordered: llama's query/key rows are permuted on the raw
block rows, exact since GGUF blocks never cross a row). No float32 weight of the model is ever made.

What `kernels.prepare` returns is kept once per file under KVCLI_HOME, keyed by the file's sha256 and the kernels'
LAYOUT_VERSION (written atomically; a kept file of another version, or one that does not read back as this file
needs, is made again). Tensors `prepare` leaves as the file's bytes are not copied: they are read from the mapped
GGUF itself, so what is kept is at most the size of the tensors the kernels rearrange. Later loads map both files
and read no GGUF header. A type the kernels do not run (Q2_K, Q3_K, IQ*) is dequantized a slice of rows at a time
and requantized to Q8_0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ModelError
from . import kernels
from .gguf_file import Header, TensorInfo, read_header

KEPT_SCHEME = 1  # the kept file's own layout (names, metadata); LAYOUT_VERSION covers prepare's tensors
ALIGN = 64  # every kept tensor starts on a cache line
_FALLBACK = "Q8_0"  # what types the kernels do not run are requantized to
_FALLBACK_ROWS = 256  # rows dequantized at a time for that
_SAFETENSORS_TYPES = {torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                      torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def kept_path(folder: Path) -> Path:
    return folder / f"packed-v{kernels.LAYOUT_VERSION}.safetensors"


class _FileBytes:
    """The GGUF file mapped copy-on-write (pages read from the file as touched, never written back)."""

    def __init__(self, path: Path, size: int):
        try:
            self.array = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", shape=(size,)))
        except (OSError, ValueError) as exc:
            raise ModelError(f"{path}: cannot map the GGUF file ({exc})") from exc

    def rows(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes [rows, bytes a row] uint8, a view of the mapped file."""
        return self.array[info.offset:info.offset + info.nbytes].view(info.rows, -1)


def _processor(header: Header, config: Any):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())


def _processed(processor: Any, mapping: dict[str, str], name: str, values: np.ndarray) -> np.ndarray | None:
    """values after transformers' processing of GGUF tensor `name` (None when it renames or consumes the tensor)."""
    result = processor.process(weights=values, name=name, tensor_key_mapping=mapping,
                               parsed_parameters={"tensors": {}, "config": processor.config})
    return None if result.weights is None or result.name != name else np.asarray(result.weights)


def _row_order(processor: Any, mapping: dict[str, str], info: TensorInfo, path: Path) -> torch.Tensor | None:
    """The order of the file's rows that gives the model's weight (None: as stored), asked of transformers'
    processor on the row numbers; a processor that does more than reorder rows is refused."""
    probe = np.arange(info.rows, dtype=np.float64).reshape(info.rows, 1)
    out = _processed(processor, mapping, info.name, probe)
    if out is None or out.size != info.rows or not np.array_equal(np.sort(out.reshape(-1)), probe.reshape(-1)):
        raise ModelError(f"{path}: transformers reshapes tensor {info.name} beyond a row order; kvcli cannot run this "
                         "file's own weights (use --weights float)")
    order = out.reshape(-1).astype(np.int64)
    return None if np.array_equal(order, probe.reshape(-1).astype(np.int64)) else torch.from_numpy(order)


def _small_values(info: TensorInfo, raw: torch.Tensor) -> torch.Tensor:
    """A small tensor (norm, bias) as float32, exactly as gguf dequantizes it."""
    if info.kind == "F32":
        return raw.reshape(-1).view(torch.float32).clone()
    if info.kind in ("F16", "BF16"):
        return raw.reshape(-1).view(torch.float16 if info.kind == "F16" else torch.bfloat16).float()
    if kernels.supported(info.kind):
        return kernels.dequantize(info.kind, kernels.prepare(info.kind, raw, info.rows, info.cols), info.rows, info.cols)
    import gguf

    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[info.kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1)


def _requantized(info: TensorInfo, raw: torch.Tensor) -> torch.Tensor:
    """Rows of a type the kernels do not run, as Q8_0 blocks [rows, bytes a row] (a slice of rows at a time)."""
    import gguf

    kind = gguf.GGMLQuantizationType[info.kind]
    parts = []
    for lo in range(0, info.rows, _FALLBACK_ROWS):
        values = gguf.quants.dequantize(raw[lo:lo + _FALLBACK_ROWS].numpy(), kind).reshape(-1, info.cols)
        parts.append(torch.from_numpy(gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)))
    return torch.cat(parts).reshape(info.rows, -1)


class _KeptWriter:
    """A safetensors file written one tensor at a time (each 64-byte aligned, padding as `_pad.N` tensors): the
    body streams to a scratch file, the header is written once every tensor is known, then the body after it."""

    def __init__(self, path: Path):
        from ...format.writing import hidden_sibling

        self.path, self.tmp = path, hidden_sibling(path)
        self.body_path = self.tmp.with_name(self.tmp.name + ".body")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.body = open(self.body_path, "wb")
        self.entries: dict[str, dict[str, Any]] = {}
        self.at = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        pad = -self.at % ALIGN
        if pad:
            self._write(f"_pad.{len(self.entries)}", torch.zeros(pad, dtype=torch.uint8))
        self._write(name, tensor)

    def _write(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
        self.body.write(memoryview(data))
        self.entries[name] = {"dtype": _SAFETENSORS_TYPES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self.at, self.at + data.size]}
        self.at += data.size

    def finish(self, metadata: dict[str, str]) -> None:
        import shutil

        self.body.close()
        head = json.dumps({"__metadata__": metadata, **self.entries}, separators=(",", ":")).encode()
        head += b" " * (-(8 + len(head)) % ALIGN)  # the body starts on a cache line too
        with open(self.tmp, "wb") as out, open(self.body_path, "rb") as body:
            out.write(len(head).to_bytes(8, "little"))
            out.write(head)
            shutil.copyfileobj(body, out, 1 << 24)
            out.flush()
            os.fsync(out.fileno())
        os.replace(self.tmp, self.path)
        self.body_path.unlink(missing_ok=True)
        for old in self.path.parent.glob("packed-v*.safetensors"):  # other layouts' files: never read again
            if old != self.path:
                old.unlink(missing_ok=True)

    def abandon(self) -> None:
        self.body.close()
        self.body_path.unlink(missing_ok=True)
        self.tmp.unlink(missing_ok=True)


def _read_kept(path: Path, sha: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The kept file's record and its tensors (mapped), or None when absent, damaged, of another version or file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if (meta.get("sha256") != sha or meta.get("layout") != str(kernels.LAYOUT_VERSION)
                    or meta.get("scheme") != str(KEPT_SCHEME)):
                return None
            record = json.loads(meta["record"])
            tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("_pad.")}
    except Exception:  # absent, cut short, not safetensors: made again
        return None
    want = {f"{name}:{key}" for name, entry in record["layers"].items() for key, where in entry["tensors"].items()
            if where == "kept"}
    return (record, tensors) if want == set(tensors) else None


def _prepare_all(header: Header, file: _FileBytes, big: dict[str, torch.Tensor | None], path: Path, sha: str,
                 kept: Path | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Run kernels.prepare over every big tensor (name -> row order) one at a time, keeping what it rearranges;
    returns the record and the prepared tensors (mapped back from the kept file where it was written)."""
    record: dict[str, Any] = {"layers": {}, "architecture": header.architecture, "size": header.size,
                              "index": {n: i.as_list() for n, i in header.tensors.items()}}
    writer = _KeptWriter(kept) if kept is not None else None
    held: dict[str, torch.Tensor] = {}
    try:
        for name, order in big.items():
            info = header.tensors[name]
            raw = file.rows(info)
            kind = info.kind
            if not kernels.supported(kind):
                raw, kind = _requantized(info, raw), _FALLBACK
            if order is not None:
                raw = raw[order]  # [rows, bytes a row]: rows in the model's order
            prepared = kernels.prepare(kind, raw, info.rows, info.cols)
            where = {}
            for key, t in prepared.items():
                same = raw.data_ptr() == file.array.data_ptr() + info.offset and t.data_ptr() == raw.data_ptr() \
                    and t.shape == raw.shape and t.dtype == torch.uint8
                where[key] = "file" if same else "kept"
                if not same:
                    if writer is not None:
                        writer.add(f"{name}:{key}", t)
                    else:
                        held[f"{name}:{key}"] = t
            record["layers"][name] = {"kind": kind, "tensors": where}
        if writer is None:
            return record, held
        writer.finish({"sha256": sha, "layout": str(kernels.LAYOUT_VERSION), "scheme": str(KEPT_SCHEME),
                       "record": json.dumps(record, separators=(",", ":"))})
    except OSError:
        if writer is not None:
            writer.abandon()
        return _prepare_all(header, file, big, path, sha, None)  # not kept: the next load prepares again
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
    again = _read_kept(kept, sha)
    if again is None:
        raise ModelError(f"{kept}: the kept tensors do not read back as written")
    return again


def _tensors_for(record: dict[str, Any], kept: dict[str, torch.Tensor], file: _FileBytes, header: Header,
                 name: str) -> tuple[str, dict[str, torch.Tensor]]:
    entry = record["layers"][name]
    out = {key: kept[f"{name}:{key}"] if where == "kept" else file.rows(header.tensors[name])
           for key, where in entry["tensors"].items()}
    return entry["kind"], out


def skeleton(config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> Any:
    """The transformers model for `config` with every weight on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    from .quiet import quiet_transformers

    with quiet_transformers(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def _header_from_record(record: dict[str, Any]) -> Header:
    tensors = {n: TensorInfo(n, *v) for n, v in record["index"].items()}
    return Header({"general.architecture": record["architecture"]}, tensors, record["size"])


def check_file(path: Path, sha: str, folder: Path | None) -> None:
    """Refuse (ModelError naming it) a file that is not a whole GGUF, before anything else reads it; a file whose
    tensors are kept, of the size recorded, is not read again."""
    found = _read_kept(kept_path(folder), sha) if folder is not None else None
    if found is None or found[0].get("size") != os.stat(path).st_size:
        read_header(path)


def load(path: Path, sha: str, model: Any, folder: Path | None) -> dict[str, Any]:
    """Fill `model` (built on the meta device from the file's config) from the GGUF file at `path` in place: linear
    layers and the embedding on the file's blocks, the rest materialised on the CPU. folder: where the kept tensors
    live (None: kept nowhere). Returns per file type the number of layers run on it."""
    size = os.stat(path).st_size
    kept = kept_path(folder) if folder is not None else None
    found = _read_kept(kept, sha) if kept is not None else None
    if found is not None and found[0].get("size") != size:
        found = None  # not the file recorded: read_header below says what is wrong with it
    header = _header_from_record(found[0]) if found is not None else read_header(path)
    file = _FileBytes(path, size)
    config = model.config.get_text_config()
    processor = _processor(header, config)
    mapping = _names(model, header, processor, path)  # gguf tensor name -> the model's parameter name
    by_param = {hf: g for g, hf in mapping.items() if g in header.tensors}
    modules = dict(model.named_modules())
    packed = {n: m for n, m in modules.items() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    sources: dict[str, str] = {}  # module name -> gguf tensor
    for name in packed:
        g = by_param.get(f"{name}.weight")
        if g is None and packed[name] is model.get_output_embeddings():  # tied: the embedding's tensor
            g = by_param.get(f"{_name_of(model.get_input_embeddings(), modules)}.weight")
        if g is None:
            raise ModelError(f"{path}: no tensor in the file for the model's layer {name}")
        sources[name] = g
    if found is None:
        big = {g: _row_order(processor, mapping, header.tensors[g], path) for g in dict.fromkeys(sources.values())}
        found = _prepare_all(header, file, big, path, sha, kept)
    record, kept_tensors = found
    report: dict[str, Any] = {}
    with torch.inference_mode():
        for name, module in packed.items():
            g = sources[name]
            info = header.tensors[g]
            kind, tensors = _tensors_for(record, kept_tensors, file, header, g)
            _check_shape(module, info, path)
            if isinstance(module, torch.nn.Embedding):
                layer = kernels.PackedEmbedding(kind, info.rows, info.cols, tensors, dtype=module.weight.dtype)
            else:
                bias = None
                if module.bias is not None:
                    bias = _small(processor, mapping, header, file, by_param, f"{name}.bias", path)
                layer = kernels.PackedLinear(kind, info.rows, info.cols, tensors, bias)
            model.set_submodule(name, layer)
            report[info.kind] = report.get(info.kind, 0) + 1
        _materialise_rest(model, processor, mapping, header, file, by_param, path)
    return {"layers": report, "backend": kernels.backend()}


def _names(model: Any, header: Header, processor: Any, path: Path) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, as transformers maps them (gguf's name map for the file's
    architecture; a name not found is tried without its first part, as transformers tries submodules), with one
    name map for the whole model."""
    import gguf

    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == header.architecture), None)
    if arch is None:
        raise ModelError(f"{path}: GGUF architecture '{header.architecture}' is unknown to the gguf package")
    layers = getattr(model.config.get_text_config(), "num_hidden_layers", 0)
    names = gguf.get_tensor_name_map(arch, layers)
    out = {}
    for hf in model.state_dict():
        hf = processor.preprocess_name(hf)
        base, _, suffix = hf.rpartition(".") if hf.endswith((".weight", ".bias")) else (hf, "", "")
        for attempt in (base, base.partition(".")[2]):
            found = names.get_name(attempt) if attempt else None
            if found is not None:
                out.setdefault(f"{found}.{suffix}" if suffix else found, hf)
                break
    return out


def _name_of(module: Any, modules: dict[str, Any]) -> str:
    return next(n for n, m in modules.items() if m is module)


def _check_shape(module: Any, info: TensorInfo, path: Path) -> None:
    rows, cols = ((module.num_embeddings, module.embedding_dim) if isinstance(module, torch.nn.Embedding)
                  else (module.out_features, module.in_features))
    if (info.rows, info.cols) != (rows, cols):
        raise ModelError(f"{path}: tensor {info.name} is {info.rows} x {info.cols}, and the model's layer wants "
                         f"{rows} x {cols}")


def _small(processor: Any, mapping: dict[str, str], header: Header, file: _FileBytes, by_param: dict[str, str],
           param: str, path: Path) -> torch.Tensor:
    g = by_param.get(param)
    if g is None:
        raise ModelError(f"{path}: no tensor in the file for the model's {param}")
    info = header.tensors[g]
    values = _small_values(info, file.rows(info))
    shape = (info.rows, info.cols) if info.rows > 1 else (info.cols,)
    done = _processed(processor, mapping, g, values.numpy().reshape(shape))
    if done is None:
        raise ModelError(f"{path}: transformers does not read tensor {g} as one parameter; use --weights float")
    return torch.from_numpy(np.ascontiguousarray(done, dtype=np.float32))


def _materialise_rest(model: Any, processor: Any, mapping: dict[str, str], header: Header, file: _FileBytes,
                      by_param: dict[str, str], path: Path) -> None:
    """Every parameter and buffer still on the meta device made on the CPU: parameters from the file (norms),
    buffers (rotary frequencies) as transformers initialises them."""
    for mod_name, module in model.named_modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_meta]
        buffers = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if not params and not buffers:
            continue
        module.to_empty(device="cpu", recurse=False)
        for n, p in module.named_parameters(recurse=False):
            if any(n == q for q, _ in params):
                full = f"{mod_name}.{n}" if mod_name else n
                values = _small(processor, mapping, header, file, by_param, full, path)
                if values.numel() != p.numel():
                    raise ModelError(f"{path}: tensor {by_param[full]} has {values.numel()} values, the model's {full} {p.numel()}")
                p.copy_(values.reshape(p.shape))
        if buffers:
            model._init_weights(module)  # transformers' own initialisation of non-persistent buffers (rotary)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelError(f"{path}: kvcli cannot make the model's {left[0]} from the file; use --weights float")
