"""Train a model: ``torchrun --nproc_per_node=N run_train.py --config-file config.yaml`` (or plain ``python``)."""

import sys

from nanotron.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
