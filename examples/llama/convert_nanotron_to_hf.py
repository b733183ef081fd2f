"""Convert a nanotron Llama checkpoint to a Hugging Face folder: ``--ckpt-path DIR --save-path DIR``."""

import sys

from nanotron.cli import main

if __name__ == "__main__":
    main(["convert", "nanotron-to-hf", *sys.argv[1:]])
