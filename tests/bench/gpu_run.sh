#!/bin/bash
# Run ON the lent device (see gpu_prepare.sh): installs the carried wheels, then, under $OUT (or out/gpu):
# the CUDA tests of the restore pipeline (every family's float32 answers against generate() on the GPU too), the restore and first-token benchmark on a 1B-shaped llama at
# 28,445 tokens (both storage settings) with float32 exactness checked on the GPU, and the 8B shape at 8,192 tokens.
# Each step has its own time limit, so one that runs long still leaves the others' results.
set -u
OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCLI_HOME=/tmp/kvcli-home
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())'; } > "$OUT/env.txt" 2>&1
# the tests' tokenizer fixture reads a saved tokenizer from KVCLI_TEST_HOME (the default model is not carried)
export KVCLI_TEST_HOME=/tmp/kvcli-test-home; mkdir -p "$KVCLI_TEST_HOME"; cp -r .gpu/tokenizer "$KVCLI_TEST_HOME/"
timeout 150 python3 -m pytest -rs -q -p no:cacheprovider tests/engine/test_restore_pipeline.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.txt"
timeout 240 python3 tests/bench/gpu_restore.py --tokenizer .gpu/tokenizer --device cuda --shape 1b --tokens 28445 \
  --dtype bfloat16 --compression small,fast --repeats 3 --check-exact > "$OUT/restore-1b.txt" 2>&1
echo "rc=$?" >> "$OUT/restore-1b.txt"
timeout 150 python3 tests/bench/gpu_restore.py --tokenizer .gpu/tokenizer --device cuda --shape 8b --tokens 8192 \
  --dtype bfloat16 --compression fast --repeats 3 > "$OUT/restore-8b.txt" 2>&1
echo "rc=$?" >> "$OUT/restore-8b.txt"
tail -n 20 "$OUT"/*.txt
