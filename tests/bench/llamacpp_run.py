"""The llama.cpp side of tests/bench/bench_llamacpp.py, run in the llama.cpp venv (.ci/llamacpp-up), never in kvcli's.

    KVCLI_LLAMACPP_VENV/bin/python tests/bench/llamacpp_run.py CONFIG.json OUT.json

CONFIG: {"gguf", "n_ctx", "threads", "workdir", "document_ids", "question_ids", "batch_ids", "eos_ids",
"max_new_tokens", "repeats", "t0"}: the exact token ids kvcli framed (no tokenizing here); t0, the parent's
time.time() when it started this process ("ready" counts the interpreter, the imports and the load). Greedy
decoding by hand (argmax of the last logits, first index on ties), stopping at an id of eos_ids, as kvcli does.
Imports only llama_cpp, numpy and the standard library. Writes timings, sizes and the answer ids to OUT.
"""

from __future__ import annotations

import ctypes
import json
import pickle
import resource
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(cfg["workdir"])
    doc, eos, limit = cfg["document_ids"], set(cfg["eos_ids"]), cfg["max_new_tokens"]
    out: dict = {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}

    t = time.perf_counter()
    llm = Llama(model_path=cfg["gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
                logits_all=False, verbose=False)
    out["load_s"], out["ready_s"] = time.perf_counter() - t, time.time() - cfg["t0"]
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm._model.model, desc, len(desc))  # "qwen2 1B Q4_K - Medium": the file's own type
    out["model_type"] = desc.value.decode().split(" ", 2)[-1]
    out["n_ctx"], out["n_batch"], out["threads"] = llm.n_ctx(), llm.n_batch, cfg["threads"]
    ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()

    def next_id() -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).argmax())

    def answer(question: list[int], limit: int = limit) -> dict:
        """From the document's state (llm.n_tokens == len(doc)): the question's forward pass, then greedy decoding."""
        t0 = time.perf_counter()
        llm.eval(question)  # drops every cell past n_tokens first (kv_cache_seq_rm), so a rewind is n_tokens = len(doc)
        ids = [next_id()]
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        while len(ids) < limit and ids[-1] not in eos:
            llm.eval([ids[-1]])
            ids.append(next_id())
        decode = time.perf_counter() - t1
        return {"ids": ids, "first_token_s": first, "decode_s": decode,
                "decode_ms_per_token": 1000 * decode / (len(ids) - 1) if len(ids) > 1 else None}

    def clear() -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        llm.reset()

    # prefill: the document's ids through the model (llama.cpp's batches of n_batch), then its state to disk
    t = time.perf_counter()
    llm.eval(doc)
    out["prefill_s"] = time.perf_counter() - t
    state = workdir / "document.llamastate"
    arr = (llama_cpp.llama_token * len(doc))(*doc)
    t = time.perf_counter()
    if not llama_cpp.llama_state_save_file(ctx, str(state).encode(), arr, len(doc)):
        raise SystemExit("llama_state_save_file failed")
    out["save_s"] = time.perf_counter() - t
    out["bytes_on_disk"] = state.stat().st_size
    # what llama-cpp-python's own save_state() gives, pickled: the same state plus its logits buffer (n_batch x vocab)
    pickled = workdir / "document.llamastate.pkl"
    t = time.perf_counter()
    with open(pickled, "wb") as f:
        pickle.dump(llm.save_state(), f, protocol=pickle.HIGHEST_PROTOCOL)
    out["pickle_save_s"] = time.perf_counter() - t
    out["pickle_bytes_on_disk"] = pickled.stat().st_size

    # each run: clear the context, restore from the state file, then one question (first token, decode)
    def restore() -> float:
        clear()
        t = time.perf_counter()
        tokens = (llama_cpp.llama_token * cfg["n_ctx"])()
        count = ctypes.c_size_t(0)
        if not llama_cpp.llama_state_load_file(ctx, str(state).encode(), tokens, cfg["n_ctx"], ctypes.byref(count)):
            raise SystemExit("llama_state_load_file failed")
        llm.n_tokens = count.value
        llm.input_ids[: count.value] = tokens[: count.value]
        took = time.perf_counter() - t
        if list(tokens[: count.value]) != doc:
            raise SystemExit("the state file's token ids are not the document's")
        return took

    restore()
    answer(cfg["question_ids"], 2)  # warm-up, as kvcli's: not measured
    restores, runs = [], []
    for _ in range(cfg["repeats"]):
        restores.append(restore())
        runs.append(answer(cfg["question_ids"]))
    out["restore_s"], out["restore_runs_s"] = statistics.median(restores), restores
    out["one"] = {"first_token_s": statistics.median(r["first_token_s"] for r in runs), "ids": runs[0]["ids"],
                  "first_token_runs_s": [r["first_token_s"] for r in runs],
                  "decode_ms_per_token": statistics.median(r["decode_ms_per_token"] for r in runs),
                  "decode_ms_per_token_runs": [r["decode_ms_per_token"] for r in runs],
                  "same_ids_every_run": all(r["ids"] == runs[0]["ids"] for r in runs)}

    # the pickled save_state() restored the way llama-cpp-python documents it, then the same first token
    clear()
    t = time.perf_counter()
    with open(pickled, "rb") as f:
        llm.load_state(pickle.load(f))
    out["pickle_restore_s"] = time.perf_counter() - t
    out["pickle_first_id_same"] = answer(cfg["question_ids"], 1)["ids"] == runs[0]["ids"][:1]

    # the batch's questions one after another, each from the document's state (a rewind, no reload)
    answers = []
    t = time.perf_counter()
    for q in cfg["batch_ids"]:
        llm.n_tokens = len(doc)
        answers.append(answer(q))
    out["sequential"] = {"wall_s": time.perf_counter() - t, "ids": [a["ids"] for a in answers],
                         "first_token_s": [a["first_token_s"] for a in answers],
                         "decode_s": sum(a["decode_s"] for a in answers),
                         "tokens": sum(len(a["ids"]) for a in answers)}
    for p in (state, pickled):
        p.unlink()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
