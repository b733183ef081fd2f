"""Generate text: ``torchrun --nproc_per_node=N run_generate.py --ckpt-path DIR --tp N --prompt "..."``."""

import sys

from nanotron.cli import main

if __name__ == "__main__":
    main(["generate", *sys.argv[1:]])
