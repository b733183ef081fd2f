"""nanotron: pretraining of large language models with explicit 3D parallelism."""

__version__ = "0.1.0"
