"""Exactness beyond float32 and short answers: bfloat16/float16 on every tiny architecture (measured with
--check: any token that differs from recompute must be a near-tie), answers of 64+ tokens, a
SentencePiece-style tokenizer with llama-2 / gemma chat templates (kvcli's split framing gives exactly
apply_chat_template's ids), and several questions at once on one Session."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kvcli
from kvcli import documents
from kvcli.documents import decode
from kvcli.engine.prompt import framing as fr
from kvcli.engine.prefilling import prefill
from tests.conftest import reference_answer, sample_text, tiny_llama
from tests.architectures import ARCHS, assert_varied, build

QUESTIONS = ("What does the word Licensor mean?", "When does the patent license terminate?")

# ---------------------------------------------------------------------------------------------------
# bfloat16 and float16: differences from recompute only where the top two logits nearly tie
# ---------------------------------------------------------------------------------------------------

NEAR_TIE = {"bfloat16": 0.5, "float16": 0.1}  # logits; measured largest differences are far below (see the summary)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_half_precision_answers_match_recompute_but_at_near_ties(tokenizer, plain_tokenizer, tmp_path, exactness_report, name, dtype):
    import torch

    tok = plain_tokenizer if ARCHS[name][1] else tokenizer
    model = build(name, tok).to(getattr(torch, dtype))
    lm = kvcli.from_objects(model, tok, name=f"tiny-{name}-{dtype}")
    prefill(lm, decode(sample_text()[:700].encode(), "licence.txt"), tmp_path / "doc.kv", chunk_size=56)
    session = kvcli.Session(lm, tmp_path / "doc.kv")
    assert session.manifest.dtype == dtype and session.manifest.num_tokens > 2 * 48  # beyond every window
    worst, differing = 0.0, 0
    questions = QUESTIONS[len(name) % 2 :][:1]  # one question per model and dtype keeps this quick
    for q in questions:
        a = session.ask(q, kvcli.GenerationOptions(max_new_tokens=12), check=True)
        c = a.check
        assert c.tokens == len(a.answer_token_ids) > 0 and c.dtype == dtype
        assert c.max_logit_diff < NEAR_TIE[dtype], (name, dtype, c.max_logit_diff)
        for d in c.divergences:  # where the greedy token differs, the two top logits nearly tie
            assert d.margin <= 2 * d.logit_diff + 1e-6, d  # it must: both paths' logits are within logit_diff
            assert d.margin < NEAR_TIE[dtype], d
        # What --check promises, on any torch: its recompute is one uncached forward over prompt + answer[:-1]
        # (the call check.compare makes). Each answer token is the cached path's top token, and the two paths'
        # logits are within max_logit_diff of each other, so wherever the recompute's top token is not the answer's,
        # the answer's token trails it by at most 2 * max_logit_diff: a near-tie, never a real disagreement.
        # (An identical verdict can still meet such a position: phi3/float16 on torch 2.13.0+cpu has an exact
        # float16 tie on the cached path at answer token 5; generate's argmax takes the lower id, check.compare's
        # topk the other one, which is also the recompute's top, 1 ulp (0.00195) above the answer's token.)
        ids = torch.tensor([a.prompt_token_ids + a.answer_token_ids[:-1]])
        n, answer = len(a.answer_token_ids), torch.tensor(a.answer_token_ids)
        with torch.inference_mode():
            ref = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=n).logits[0].float()
            # a plain teacher-forced forward (all positions' logits, default mask and cache) runs other kernel shapes:
            # in half precision its logits move in the last bits, by how much depends on the torch build
            plain = model(input_ids=ids).logits[0, len(a.prompt_token_ids) - 1 :].float()

        def trails(logits):  # [n]: how far the answer's token is below the top logit (0 where it is the top)
            return logits.amax(-1) - logits.gather(-1, answer[:, None])[:, 0]

        gap = trails(ref)
        for i in (gap > 0).nonzero().flatten().tolist():
            assert gap[i] <= 2 * c.max_logit_diff + 1e-4 and gap[i] < NEAR_TIE[dtype], (name, dtype, i, float(gap[i]), c.describe())
        # the plain forward: within NEAR_TIE of the check's recompute, and picking another token only at a near-tie
        drift = (plain - ref).abs().amax(-1)  # [n]
        assert float(drift.max()) < NEAR_TIE[dtype], (name, dtype, float(drift.max()))
        plain_gap = trails(plain)
        for i in (plain_gap > 0).nonzero().flatten().tolist():
            assert plain_gap[i] <= gap[i] + 2 * drift[i] + 1e-4 and plain_gap[i] < NEAR_TIE[dtype], (name, dtype, i, float(plain_gap[i]))
        worst, differing = max(worst, c.max_logit_diff), differing + (not c.identical)
    exactness_report.append(f"{dtype:>8} {name:<12} largest |logit diff| {worst:.3g}; answers differing: {differing}/{len(questions)}")


# ---------------------------------------------------------------------------------------------------
# Answers of 64+ tokens
# ---------------------------------------------------------------------------------------------------

LONG = 64


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # full attention; sliding (window 24) and full alternating
def test_long_answers_are_exact(tokenizer, tmp_path, exactness_report, name):
    model = build(name, tokenizer)
    lm = kvcli.from_objects(model, tokenizer, name=f"tiny-{name}")
    prefill(lm, decode(sample_text()[:700].encode(), "licence.txt"), tmp_path / "doc.kv", chunk_size=56)
    a = kvcli.Session(lm, tmp_path / "doc.kv").ask(QUESTIONS[0], kvcli.GenerationOptions(max_new_tokens=LONG), check=True)
    assert len(a.answer_token_ids) == LONG and len(set(a.answer_token_ids)) > 10  # long and varied
    assert a.answer_token_ids == reference_answer(model, a.prompt_token_ids, LONG)
    assert a.check.identical and a.check.tokens == LONG
    exactness_report.append(f" float32 {name:<12} {LONG}-token answer identical, largest |logit diff| {a.check.max_logit_diff:.3g}")


# ---------------------------------------------------------------------------------------------------
# A 16,384-token document: full attention, and sliding layers with a full one
# ---------------------------------------------------------------------------------------------------

LONG_DOC = 16384


@pytest.fixture(scope="module")
def long_document(tiny_lm, tokenizer):
    """The sample repeated and cut to 16,384 framed tokens of this tokenizer, as kvcli bench builds its lengths."""
    from kvcli import bench

    return bench.document_of(tiny_lm, fr.choose(tokenizer, "auto", None), decode(sample_text().encode(), "licence.txt"), LONG_DOC)


def _long_model(name: str, tokenizer):
    if name == "llama":
        return tiny_llama(len(tokenizer), max_position_embeddings=32768)
    # gemma 3's structure in two layers: a sliding layer (window 48) and a full one; 32,768 positions
    return build(name, tokenizer, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_answers_on_a_16k_token_document_are_exact(tokenizer, tmp_path, exactness_report, long_document, name):
    model = _long_model(name, tokenizer)
    assert model.config.max_position_embeddings >= 2 * LONG_DOC
    lm = kvcli.from_objects(model, tokenizer, name=f"tiny-{name}")
    prefill(lm, long_document, tmp_path / "doc.kv")
    session = kvcli.Session(lm, tmp_path / "doc.kv")
    assert LONG_DOC - 4 <= len(session.token_ids) <= LONG_DOC  # cut at a character: the last tokens may merge
    opts = kvcli.GenerationOptions(max_new_tokens=8)
    alone = session.ask(QUESTIONS[0], opts)
    together = session.ask_many(QUESTIONS, opts)  # batched: both rows share the document's keys/values
    assert together[0].answer_token_ids == alone.answer_token_ids
    for a in together:
        ref = reference_answer(model, a.prompt_token_ids, 8)
        assert_varied(ref)
        assert a.answer_token_ids == ref
    exactness_report.append(f" float32 {name:<12} {len(session.token_ids):,}-token document: {len(together)} answers "
                            f"identical to generate() ({together[0].decoding})")


# ---------------------------------------------------------------------------------------------------
# SentencePiece-style tokenizers and their chat templates
# ---------------------------------------------------------------------------------------------------

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (  # gemma-3: a system message is put at the start of the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
BYTES = [f"<0x{i:02X}>" for i in range(256)]


def _train_bpe(specials: list[str], text_pieces: list[str]) -> tuple[dict, list]:
    """A small SentencePiece-style BPE vocabulary (pieces start with ▁, byte fallback), trained offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tk.train_from_iterator(text_pieces, trainers.BpeTrainer(vocab_size=900, special_tokens=specials + BYTES, show_progress=False))
    body = json.loads(tk.to_str())["model"]
    return body["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in body["merges"]]


@pytest.fixture(scope="module")
def sp_tokenizers():
    """llama-2: transformers' LlamaTokenizer pipeline (Metaspace with a prefix space, newlines as byte pieces);
    gemma: GemmaTokenizer (no prefix space, whitespace pieces such as '.\\n\\n' that merge across the cut)."""
    from transformers import GemmaTokenizer, LlamaTokenizer

    text = sample_text()
    vocab, merges = _train_bpe(["<unk>", "<s>", "</s>"], [line for line in text.splitlines() if line.strip()])
    llama = LlamaTokenizer(vocab=vocab, merges=merges)
    llama.chat_template = LLAMA2_TEMPLATE
    turns = ["<start_of_turn>", "<end_of_turn>"]
    vocab, merges = _train_bpe(["<pad>", "<eos>", "<bos>", "<unk>", *turns], [text.replace("\n\n", "\n\n ")])
    gemma = GemmaTokenizer(vocab=vocab, merges=merges, additional_special_tokens=turns)
    gemma.chat_template = GEMMA_TEMPLATE
    return {"llama2": llama, "gemma": gemma}


DOCS = (
    sample_text()[:700],
    "Minutes of the 3 May meeting: Bruno will order forty chairs; the hall opens at nine.",
    sample_text()[1000:1400] + " (see \u00a73)",
    "  spaced   doc ending in a number 42  ",
    "\u00dcn\u00efc\u00f6d\u00e9 text: \u6771\u4eac\u3002\u6771\u4eac\u90fd.",
)
FRAMING_QUESTIONS = ("What is it?", "Who signs?", "Why\nnot?", "42?", "(a) or (b)", "\u00bfQu\u00e9?")


def _template_ids(tok, system, document: str, question: str) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": document.strip() + fr.SEPARATOR + question.strip()})
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.parametrize("which", ["llama2", "gemma", "smollm2-chatml"])
def test_split_framing_gives_exactly_the_chat_templates_ids(sp_tokenizers, tokenizer, which):
    tok = tokenizer if which == "smollm2-chatml" else sp_tokenizers[which]
    cuts = 0
    for system in (None, "Be brief."):
        for document in DOCS:
            cached, frame = fr.split_document(tok, fr.choose(tok, "chat", system), document)
            cuts += frame.cut
            for q in FRAMING_QUESTIONS:
                assert cached + fr.question_ids(tok, frame, q, cached) == _template_ids(tok, system, document, q), (document[-30:], q)
    if which == "smollm2-chatml":
        assert cuts == 0  # byte-level BPE always breaks at the document's end: caches stay framing version 1
    else:
        assert cuts > 0  # the tokenizers this test builds do need the cut


@pytest.mark.parametrize("which", ["llama2", "gemma"])
def test_plain_framing_with_sentencepiece_gives_the_whole_texts_ids(sp_tokenizers, which):
    tok = sp_tokenizers[which]
    for document in DOCS:
        cached, frame = fr.split_document(tok, fr.choose(tok, "plain"), document)
        for q in FRAMING_QUESTIONS:
            whole = tok(document.strip() + f"\n\nQuestion: {q.strip()}\nAnswer:")["input_ids"]
            assert cached + fr.question_ids(tok, frame, q, cached) == list(whole)


def test_sentencepiece_end_to_end_is_exact_and_uses_the_templates_ids(sp_tokenizers, tmp_path):
    """A tiny llama with the llama-2 tokenizer: the cache records the cut (framing version 2), every question's
    prompt is apply_chat_template's ids, and the answers equal recompute."""
    tok = sp_tokenizers["llama2"]
    model = tiny_llama(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    lm = kvcli.from_objects(model, tok, name="tiny-llama-sp")
    document = DOCS[0]
    prefill(lm, decode(document.encode(), "d.txt"), tmp_path / "d.kv", chunk_size=64)
    session = kvcli.Session(lm, tmp_path / "d.kv")
    assert session.manifest.framing["version"] == fr.FRAMING_VERSION_CUT and session.manifest.framing["anchor_tokens"] > 0
    for q in QUESTIONS:
        a = session.ask(q, kvcli.GenerationOptions(max_new_tokens=10), check=True)
        assert a.prompt_token_ids == _template_ids(tok, None, document, q)
        assert a.answer_token_ids == reference_answer(model, a.prompt_token_ids, 10) and a.check.identical


def test_corpus_rerun_with_a_tokenizer_that_moves_the_cut_skips_everything(sp_tokenizers, tmp_path):
    """A SentencePiece-style tokenizer records the cut (framing version 2, an anchor): a second corpus run over
    the same documents is up to date, document by document, reading manifests only; another system prompt
    is not."""
    from kvcli.engine import corpus

    tok = sp_tokenizers["llama2"]
    lm = kvcli.from_objects(tiny_llama(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id), tok,
                            name="tiny-llama-sp")
    texts = {f"d{i}.txt": t for i, t in enumerate(DOCS)}

    def statuses(**options) -> list[str]:
        jobs = corpus.plan(list(texts), lambda e: corpus.LocalTarget(tmp_path / documents.cache_name(e)))
        results = list(corpus.run(lm, jobs, read=lambda e: decode(texts[e].encode(), e), chunk_size=64, **options))
        assert not [r.error for r in results if r.error], results
        return [r.status for r in results]

    assert statuses() == ["built"] * len(DOCS)
    cut = [kvcli.read_manifest(tmp_path / documents.cache_name(e)).framing for e in texts]
    assert any(f["version"] == fr.FRAMING_VERSION_CUT for f in cut)  # the tokenizer moved the cut for some
    assert statuses() == ["skipped"] * len(DOCS)
    assert statuses(system="Be brief.") == ["built"] * len(DOCS)  # what decides the cache changed
    assert statuses(system="Be brief.") == ["skipped"] * len(DOCS)


# ---------------------------------------------------------------------------------------------------
# Several questions at once on one Session
# ---------------------------------------------------------------------------------------------------

THREAD_QUESTIONS = ("What does the word Licensor mean?", "Who may grant a license?", "What is a Work?",
                    "Is the Work provided with any warranty?")


@pytest.fixture(scope="module")
def threaded(tiny_lm, tmp_path_factory):
    path = tmp_path_factory.mktemp("threads") / "doc.kv"
    prefill(tiny_lm, decode(sample_text()[:1500].encode(), "licence.txt"), path, chunk_size=128)
    session = kvcli.Session(tiny_lm, path)
    opts = kvcli.GenerationOptions(max_new_tokens=12)
    serial = [session.ask(q, opts) for q in THREAD_QUESTIONS]
    with ThreadPoolExecutor(max_workers=len(THREAD_QUESTIONS)) as pool:
        parallel = list(pool.map(lambda q: session.ask(q, opts), THREAD_QUESTIONS))
    return serial, parallel


def test_questions_at_once_on_one_session_equal_the_serial_answers(threaded):
    serial, parallel = threaded
    assert [a.answer_token_ids for a in parallel] == [a.answer_token_ids for a in serial]
    assert [a.answer for a in parallel] == [a.answer for a in serial]
    assert [a.prompt_token_ids for a in parallel] == [a.prompt_token_ids for a in serial]


def test_questions_at_once_count_only_their_own_tokens(threaded):
    serial, parallel = threaded
    assert [a.processed_tokens for a in parallel] == [a.processed_tokens for a in serial]
    assert all(a.processed_tokens == a.new_tokens + len(a.answer_token_ids) - 1 for a in parallel)


# ---------------------------------------------------------------------------------------------------
# One question's steps taking each way (engine/decoding/solo.py): workers spinning and products split across
# the threads, spinning and products whole, or workers sleeping beside a pool and products whole
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])  # full attention: the lone row decodes solo; biased q/k/v; q/k norms
def test_steps_split_or_not_give_generates_tokens(tokenizer, tmp_path, monkeypatch, name):
    from kvcli.engine.model import cpu, linear

    monkeypatch.setattr(linear, "SPLIT_MIN", 1)  # the tiny models' products split too, in parts of 16 rows
    monkeypatch.setattr(linear, "ROWS", 16)
    ways = iter([cpu.SPLIT, cpu.SPLIT, cpu.SLEEP, cpu.WHOLE] * 20)
    monkeypatch.setattr(cpu.Faster, "pick", lambda self: next(ways))
    split, beside, owners = [], [], []
    real_split, real_beside = linear.split_product, cpu.CpuTuning.pool_beside
    monkeypatch.setattr(linear, "split_product", lambda *a: split.append(a[1].shape) or real_split(*a))
    monkeypatch.setattr(cpu.CpuTuning, "pool_beside",
                        lambda self, on: owners.append(self) or beside.append(on) or real_beside(self, on))
    model = build(name, tokenizer)
    linear.use_split_linears(model)  # as load() does for the models it loads
    lm = kvcli.from_objects(model, tokenizer, name=f"tiny-{name}")
    prefill(lm, decode(sample_text()[:700].encode(), "licence.txt"), tmp_path / "doc.kv", chunk_size=56)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite's workers run one thread (conftest): two, for the parts to spread over
    try:
        a = kvcli.Session(lm, tmp_path / "doc.kv").ask(QUESTIONS[0], kvcli.GenerationOptions(max_new_tokens=24))
    finally:
        for owner in set(owners):
            owner.close()
        torch.set_num_threads(threads)
    assert len(a.answer_token_ids) == 24 and len(set(a.answer_token_ids)) > 5
    assert any(rows > 16 for rows, _in in split) and all(o.same_bits and all(o.same_bits.values()) for o in owners)  # same bits
    assert True in beside and False in beside
    assert a.answer_token_ids == reference_answer(model, a.prompt_token_ids, 24)
