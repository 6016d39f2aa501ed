#!/bin/sh
# Run HERE (not on the device), in the repository root with kvcli's venv active, before a device run:
# downloads the cp312 wheels of kvcli's pins that the device's python lacks into .whl/, saves the default
# model's tokenizer into .gpu/tokenizer, and ignores both (.git/info/exclude). Then, with the device tool:
#   run(command="bash tests/bench/gpu_run.sh", carry=[".whl", ".gpu"], timeout_s=540)
set -eu
exclude="$(git rev-parse --git-path info/exclude)"
for d in /.whl/ /.gpu/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
mkdir -p .whl .gpu
pins() { grep -i "^$1==" constraints.txt | head -1; }
for name in transformers zstandard blake3 gguf; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$(pins $name)"
done
python - <<'PY'
from transformers import AutoTokenizer
from kvcli.engine.model.models import default_gguf_path
g = default_gguf_path()
AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name).save_pretrained(".gpu/tokenizer")
PY
du -sh .whl .gpu
