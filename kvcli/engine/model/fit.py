"""Whether a cache fits the loaded model: same model, tokenizer, template, framing, dtype and layer layout."""

from __future__ import annotations

from ..cache import layers
from ...errors import CacheMismatchError
from ...format import manifest as mf
from ...format.identity import HASHES, STRUCTURE
from ..prompt.framing import SUPPORTED_VERSIONS
from .models import LoadedModel

_CHECKED = STRUCTURE[:1] + HASHES + STRUCTURE[1:]  # the order refusals list them in


def check_fits(manifest: mf.Manifest, lm: LoadedModel, where: str, *, convert_dtype: bool = False) -> None:
    """Refuse (CacheMismatchError) a cache built with another model, tokenizer, template, dtype or layout."""
    have, want = lm.fingerprint, manifest.model
    diffs = [label for key, label in _CHECKED if have.get(key) != want.get(key)]
    if want.get("weights_scheme") != have.get("weights_scheme") and "weights" in diffs:  # an older scheme sampled the weights
        diffs[diffs.index("weights")] = "weights fingerprint (the cache's covers only samples of the weights: rebuild it)"
    if manifest.framing.get("kind") == "chat":
        template = have.get("chat_template_sha256")
        if template is None or template != manifest.framing.get("template_sha256"):
            diffs.append("chat template")
    if manifest.framing.get("version") not in SUPPORTED_VERSIONS:
        diffs.append("prompt framing version")
    if lm.weights != manifest.weights:  # another arithmetic (engine/model/stored.py)
        diffs.append(f"weights (cache {manifest.weights}, model {lm.weights}; "
                     "load the model with the cache's --weights)")
    if have.get("dtype") != want.get("dtype") and not convert_dtype:
        diffs.append(f"dtype (cache {want.get('dtype')}, model {have.get('dtype')}; --convert-dtype allows it)")
    limit = have.get("max_positions")
    if limit and manifest.num_tokens >= limit:
        diffs.append(f"length ({manifest.num_tokens} cached tokens, the model takes {limit} positions)")
    if diffs:
        raise CacheMismatchError(f"{where}: built for another model ({manifest.model_name}): differs in {', '.join(diffs)}")
    _check_token_ids(manifest, lm, where)
    plan = layers.plan(lm.model.config)
    for layer, (kind, window) in zip(manifest.layers, plan):
        if (layer.kind, layer.sliding_window) != (kind, window):
            raise CacheMismatchError(
                f"{where}: layer {layer.index} is {layer.kind} (window {layer.sliding_window}) in the cache, "
                f"{kind} (window {window}) in the model"
            )


def check_request(manifest: mf.Manifest, where: str, *, dtype: str | None, convert_dtype: bool = False) -> None:
    """What can be refused from the manifest alone, before any model loads (a refused request loads
    nothing): a --dtype other than the cache's without --convert-dtype. check_fits says the same later."""
    want = manifest.model
    if dtype and dtype != "auto" and dtype != want.get("dtype") and not convert_dtype:
        raise CacheMismatchError(f"{where}: built for another model ({manifest.model_name}): differs in dtype (cache {want.get('dtype')}, "
                                 f"model {dtype}; --convert-dtype allows it)")


def vocab_limit(lm: LoadedModel) -> int | None:
    """How many token ids the model and its tokenizer can produce: the smaller of the tokenizer's size and
    the embedding's rows (an embedding padded past the tokenizer has rows no tokenizer output selects)."""
    sizes = []
    try:
        sizes.append(len(lm.tokenizer))
    except TypeError:
        pass
    embed = lm.model.get_input_embeddings() if hasattr(lm.model, "get_input_embeddings") else None
    rows = getattr(embed, "num_embeddings", None)
    if isinstance(rows, int):
        sizes.append(rows)
    return min(sizes) if sizes else None


def _check_token_ids(manifest: mf.Manifest, lm: LoadedModel, where: str) -> None:
    """Refuse cached ids the tokenizer cannot have produced (a forged manifest): an id past the embedding
    would crash the recompute of --check, and one in padded rows would answer from a prompt no text gives."""
    limit = vocab_limit(lm)
    if limit is None or max(manifest.token_ids) < limit:
        return
    for i, t in enumerate(manifest.token_ids):
        if t >= limit:
            raise CacheMismatchError(
                f"{where}: token id {t} at position {i} is outside the model's vocabulary of {limit} ids "
                "(no tokenizer output; the manifest was forged or built for another model)"
            )
