"""Loading a model silences transformers' progress bars only while it runs: a user's own setting
(bars off, or on) is what stays afterwards."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("enabled", [False, True])
def test_loading_keeps_the_users_progress_bar_setting(tiny_model_dir, enabled):
    from transformers.utils import logging as hf_logging

    from kvcli.engine.model import models

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        with models._quiet_transformers():
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled() is enabled
        models.load(str(tiny_model_dir))
        assert hf_logging.is_progress_bar_enabled() is enabled
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
