#!/usr/bin/env sh
# Ask every question in questions.txt about document.txt, paying for the document once.
# The cache is rebuilt when it is missing or no longer fits the model (exit code 3).
set -eu
cd "$(dirname "$0")"
# An answer that falls into a loop ends there (--stop-loops; docs/models-and-framing.md, "Small models and loops").
ask() { kvcli ask --cache document.kv -f questions.txt --json --quiet > answers.jsonl; }
ask || { [ $? -eq 3 ] && kvcli prefill document.txt --force --quiet && ask; }
# One JSON object per line: print question and answer.
python3 -c 'import json,sys; [print(f"Q: {a[\"question\"]}\nA: {a[\"answer\"]}\n") for a in map(json.loads, open("answers.jsonl"))]'
