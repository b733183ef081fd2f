"""Convert a Hugging Face Llama folder to a nanotron checkpoint: ``--hf-path DIR --save-path DIR``."""

import sys

from nanotron.cli import main

if __name__ == "__main__":
    main(["convert", "hf-to-nanotron", *sys.argv[1:]])
