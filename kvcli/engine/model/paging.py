"""A loaded model's weights brought into memory before its first forward pass."""

from __future__ import annotations

from typing import Any


def page_in(model: Any) -> None:
    """Read every CPU weight once. Weights read from safetensors are mapped from the file, and the first forward
    pass would otherwise fault them in page by page, costing the first question more than this one read
    (tests/bench/bench_coldstart.py measures both)."""
    import torch

    seen: set[int] = set()
    with torch.inference_mode():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type != "cpu" or not t.numel() or t.dtype == torch.bool or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            t.detach().amax()  # [] : the value is not needed, only the pages
