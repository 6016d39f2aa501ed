"""The dtypes a cache may store: the one table the manifest, the shard headers, the codec and model loading use.

Each name is also torch's (`getattr(torch, name)`); no torch import here, so light commands stay light.
"""

from __future__ import annotations

# name -> (bytes per element, safetensors dtype code)
DTYPES: dict[str, tuple[int, str]] = {
    "float32": (4, "F32"),
    "bfloat16": (2, "BF16"),
    "float16": (2, "F16"),
}
ITEM_SIZES = {name: size for name, (size, _code) in DTYPES.items()}
SAFETENSORS = {name: code for name, (_size, code) in DTYPES.items()}
