"""DoReMi step 2: train the proxy model against the reference (``doremi.ref_model_resume_checkpoint_path``), its
domain weights updated every step: ``python examples/doremi/train_doremi.py --config-file proxy.yaml``."""

import sys

from nanotron.cli import main

if __name__ == "__main__":
    main(["doremi", "train", *sys.argv[1:]])
