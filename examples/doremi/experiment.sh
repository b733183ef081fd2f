#!/usr/bin/env bash
# DoReMi on the six-domain demo corpus, end to end on a CPU (about 25 minutes on 2 cores): data with a held-out
# split per domain, the reference, the proxy, its averaged weights, then a 7x larger model trained on the same
# number of tokens with the natural, the uniform and the DoReMi mixture, each evaluated per held-out domain.
# Results and their reading: docs/doremi.md. Steps whose output exists are skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
NANOTRON=${NANOTRON:-.venv/bin/nanotron}
PYTHON=${PYTHON:-.venv/bin/python}
W=work/doremi
DOMAINS="scripture dictionary quotes code techdocs multilingual"

[ -f $W/corpus/manifest.json ] || $PYTHON scripts/build_corpus.py --output-dir $W/corpus --max-mb-per-domain 4
[ -f $W/tokenizer/tokenizer.json ] || $NANOTRON train-tokenizer --input $W/corpus --vocab-size 4096 --output $W/tokenizer
for domain in $DOMAINS; do
  for split in train held-out; do
    [ -f $W/$split/$domain/metadata.json ] || $NANOTRON preprocess --input $W/corpus/$domain.jsonl \
      --tokenizer $W/tokenizer/tokenizer.json --output-folder $W/$split/$domain --held-out-every 20 --split $split
  done
done

# A finished run is skipped (its folder has a checkpoint of the last step: latest.txt).
[ -f checkpoints/doremi/reference/latest.txt ] || \
  $PYTHON examples/doremi/train_reference.py --config-file examples/doremi/config_reference.yaml
[ -f checkpoints/doremi/proxy/latest.txt ] || \
  $PYTHON examples/doremi/train_doremi.py --config-file examples/doremi/config_proxy.yaml
WEIGHTS=$($NANOTRON doremi average --history checkpoints/doremi/proxy/domain_weights.jsonl \
  --output $W/doremi_weights.json | sed -e 's/^domain_weights: //' -e 's/ *#.*//')
echo "DoReMi weights: $WEIGHTS"

UNIFORM="[$(echo $DOMAINS | awk '{for (i = 1; i <= NF; i++) printf "%s1.0", (i > 1 ? ", " : "")}')]"
for mixture in natural uniform doremi; do
  case $mixture in
    natural) extra=() ;;
    uniform) extra=("data_stages.0.data.dataset.dataset_weights=$UNIFORM") ;;
    doremi) extra=("data_stages.0.data.dataset.dataset_weights=$WEIGHTS") ;;
  esac
  [ -f checkpoints/doremi/large_$mixture/latest.txt ] || $PYTHON run_train.py \
    --config-file examples/doremi/config_large.yaml --override checkpoints.checkpoints_path=checkpoints/doremi/large_$mixture \
    general.run=large_$mixture ${extra[@]+"${extra[@]}"}
  $NANOTRON eval --ckpt-path checkpoints/doremi/large_$mixture --sequence-length 128 --max-windows 1000 \
    --output $W/eval_$mixture.json --data $(for domain in $DOMAINS; do printf "$W/held-out/%s " $domain; done)
done
$NANOTRON plot --metrics checkpoints/doremi/proxy --output docs/doremi_proxy.png
