"""transformers kept quiet while kvcli loads a model: kvcli reports progress itself (on stderr, rich)."""

from __future__ import annotations


class quiet_transformers:
    """Silence transformers' own progress bars and info logs (kvcli reports progress itself)."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        self._gguf_tqdm = gguf_utils.tqdm
        gguf_utils.tqdm = lambda iterable, **_: iterable  # the GGUF reader's own bar ignores the switch below
        self._level = hf_logging.get_verbosity()
        self._bars = hf_logging.is_progress_bar_enabled()  # a user who turned them off keeps them off
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._level)
        if self._bars:
            hf_logging.enable_progress_bar()
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_utils.tqdm = self._gguf_tqdm
