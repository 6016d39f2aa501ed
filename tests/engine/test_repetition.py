"""The anti-repetition options (--repetition-penalty, --no-repeat-ngram-size): answers from the cache equal
generate() on the full prompt, on the command line and in the Python API; bad values are usage errors."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvcli
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, json_lines, run


@pytest.mark.parametrize("settings", [("--repetition-penalty", "0.2"), ("--no-repeat-ngram-size", "3"),
                                      ("--repetition-penalty", "1.2", "--no-repeat-ngram-size", "4")])
def test_repetition_options_equal_generate_on_the_full_prompt(cache_dir, tiny_model_dir, settings):
    from transformers import AutoModelForCausalLM

    # --stop-loops 0: generate() has no such stop, and a random model under these settings loops
    result = run("ask", "-c", cache_dir, "--json", "--ids", "--max-new-tokens", "24", "--stop-loops", "0", *settings, "What is the Licensor?")
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    (plain,) = json_lines(run("ask", "-c", cache_dir, "--json", "--max-new-tokens", "24", "--stop-loops", "0", "What is the Licensor?").stdout)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    kw = dict(zip([s.lstrip("-").replace("-", "_") for s in settings[::2]], [float(v) if "." in v else int(v) for v in settings[1::2]]))
    assert a["answer_token_ids"] == _generate(model, a["prompt_token_ids"], 24, **kw)
    if "--no-repeat-ngram-size" in settings:  # no n-gram of the answer occurred earlier in prompt or answer
        n, ids = kw["no_repeat_ngram_size"], a["prompt_token_ids"] + a["answer_token_ids"]
        start = len(a["prompt_token_ids"]) - n + 1
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        assert all(grams[i] not in grams[:i] for i in range(start, len(grams)))
    else:
        # the penalty reaches generate(): below 1 it favours the prompt's tokens, and the answer changes
        # (above 1 it often cannot change a random model's answer, whose picks are rarely prompt tokens)
        assert a["answer_token_ids"] != plain["answer_token_ids"]


def test_repetition_options_in_the_python_api(tiny_lm, tmp_path):
    doc = kvcli.read_document(_write(tmp_path / "d.txt", sample_text()[:1500]))
    kvcli.prefill(tiny_lm, doc, tmp_path / "d.kv")
    session = kvcli.Session(tiny_lm, tmp_path / "d.kv")
    opts = kvcli.GenerationOptions(max_new_tokens=20, repetition_penalty=1.25, no_repeat_ngram_size=2)
    a = session.ask("Is there a warranty?", opts)
    assert a.answer_token_ids == _generate(tiny_lm.model, a.prompt_token_ids, 20, repetition_penalty=1.25, no_repeat_ngram_size=2)


def test_bad_repetition_penalty_is_a_usage_error(cache_dir):
    assert_clean_error(run("ask", "-c", cache_dir, "--repetition-penalty", "0", "Q?"), 2, "--repetition-penalty")
    assert run("ask", "-c", cache_dir, "--no-repeat-ngram-size", "-1", "Q?").exit_code == 2


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _generate(model, prompt_ids, max_new_tokens, **settings):
    import torch

    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, **settings)
    return out[0, len(prompt_ids):].tolist()
