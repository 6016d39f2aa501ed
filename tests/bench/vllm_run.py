"""Runs inside the vLLM venv (not kvcli's): answers prompts with vLLM, with or without KvcliConnector.

Used by tests/integrations/test_vllm.py and tests/bench/bench_vllm.py: `python tests/bench/vllm_run.py CONFIG.json OUT.json`.
CONFIG: {"model", "caches" (null: no connector), "stats_file", "probe_dir" (the connector is vllm_probe.py's
ProbingConnector, which writes probe_dir/TAG.pt for a request whose params hold {"probe": TAG}), "max_tokens",
"logprobs", "logprobs_mode" (e.g. "raw_logits": the top values are logits), "keep_top",
"requests": [{"tag", "ids" | "chat": [messages], "params": {kv_transfer_params}, "max_tokens"?}],
"steps": [[tag, ...], ...] (requests generated together, one list after the other; default one by one;
a step {"replace": [SRC, DST]} moves folder SRC over DST first)}.
OUT: per tag the generated ids, text, top-2 logprobs per step, num_cached_tokens, prompt length, seconds
(wall time of its generate call), plus the engine's init time.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if cfg.get("caches"):
        probing = bool(cfg.get("probe_dir"))  # vllm_probe.py, beside this script (on sys.path)
        kw["kv_transfer_config"] = {
            "kv_connector": "ProbingConnector" if probing else "KvcliConnector",
            "kv_connector_module_path": "vllm_probe" if probing else "kvcli.integrations.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"caches": cfg["caches"], "stats_file": cfg.get("stats_file"),
                                          "probe_dir": cfg.get("probe_dir")},
        }
    llm = LLM(model=cfg["model"], dtype="float32", max_model_len=cfg.get("max_model_len", 4096), enforce_eager=True,
              enable_prefix_caching=False, seed=0, **({"logprobs_mode": cfg["logprobs_mode"]} if cfg.get("logprobs_mode") else {}),
              **kw)
    out = {"init_seconds": time.perf_counter() - started, "results": {}}
    requests = {r["tag"]: r for r in cfg["requests"]}
    steps = cfg.get("steps") or [[t] for t in requests]
    for step in steps:
        if isinstance(step, dict) and "replace" in step:  # replace a cache folder while vLLM runs (stale-manifest test)
            import shutil

            src, dst = step["replace"]
            shutil.rmtree(dst)
            os.rename(src, dst)
            continue
        prompts, params, chats = [], [], []
        for tag in step:
            r = requests[tag]
            extra = {"kv_transfer_params": r["params"]} if r.get("params") else None
            params.append(SamplingParams(temperature=0, max_tokens=r.get("max_tokens", cfg.get("max_tokens", 32)),
                                         logprobs=cfg.get("logprobs", 2), extra_args=extra))
            if "chat" in r:
                chats.append(r["chat"])
            else:
                prompts.append(TokensPrompt(prompt_token_ids=r["ids"]))
        t = time.perf_counter()
        if chats:
            assert len(chats) == len(step), "a step is all chat requests or none"
            results = llm.chat(chats, params, use_tqdm=False)
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        for tag, res in zip(step, results):
            o = res.outputs[0]
            top = []
            for step_lp in o.logprobs or []:
                ranked = sorted(step_lp.items(), key=lambda kv: kv[1].rank)
                top.append([[tid, lp.logprob] for tid, lp in ranked[:cfg.get("keep_top", 2)]])
            out["results"][tag] = {"ids": list(o.token_ids), "text": o.text, "top": top,
                                   "num_cached_tokens": res.num_cached_tokens,
                                   "prompt_tokens": len(res.prompt_token_ids or []),
                                   "prompt_ids": list(res.prompt_token_ids or []), "seconds": seconds}
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
