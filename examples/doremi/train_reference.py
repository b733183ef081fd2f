"""DoReMi step 1: train the reference model at fixed domain weights (``doremi.domain_weights``, or the natural
token shares when unset): ``python examples/doremi/train_reference.py --config-file ref.yaml``."""

import sys

from nanotron.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
