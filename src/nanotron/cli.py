"""The ``nanotron`` command: ``train``, ``preprocess``, ``train-tokenizer``, ``generate``, ``eval``, ``convert``,
``checkpoint verify``, ``plot``, ``doremi train|average``, ``estimate-memory``, ``estimate``, ``schedule``.

Every subcommand checks its options while they are parsed (numeric ranges, output paths), before any work, and turns
a bad command line and the library's user-facing errors (bad config, data, tokenizer or checkpoint) into a single
``error:`` line and exit status 2, instead of a traceback.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from nanotron.generation.generate import SamplingArgs


def _train(args: argparse.Namespace) -> None:
    _run_training(args)


def _run_training(args: argparse.Namespace, doremi_proxy: bool = False) -> None:
    from nanotron.config import load_config
    from nanotron.features import features_for
    from nanotron.trainer import Trainer

    config = load_config(args.config_file, args.override)
    trainer = Trainer(config, features=features_for(config, doremi_proxy=doremi_proxy))
    try:
        trainer.train()
    finally:
        trainer.close()
        # A gloo process group joins its threads when it is freed, not when destroyed, and the trainer's groups are
        # held in reference cycles (gradient hooks, modules) that only the collector frees: left to the interpreter's
        # exit, they are torn down beside its finalisation, where a rank can abort ("terminate called without an
        # active exception") after a finished run and torchrun reports a failure.
        del trainer
        gc.collect()


def _preprocess(args: argparse.Namespace) -> None:
    from nanotron.data.preprocess import preprocess

    metadata = preprocess(args.input, args.tokenizer, args.output_folder, args.text_key, args.num_workers,
                          split=args.split, held_out_every=args.held_out_every)
    print(f"wrote {metadata['num_tokens']:,} tokens from {metadata['num_documents']:,} documents to "
          f"{args.output_folder}")


def _train_tokenizer(args: argparse.Namespace) -> None:
    from nanotron.data.tokenizer import train_tokenizer

    path = train_tokenizer(args.input, args.vocab_size, args.output, args.text_key, args.min_frequency)
    print(f"wrote {path}")


def _generate(args: argparse.Namespace) -> None:
    from nanotron.config import ConfigError
    from nanotron.data.tokenizer import eos_token_id
    from nanotron.generation.generate import (
        check_checkpoint_layout,
        generate,
        load_checkpoint_tokenizer,
        load_model,
    )
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    sampling = _sampling(args)
    prompts = [prompt for prompt in args.prompt or [] if prompt.strip()]
    if args.prompts_file:
        if not args.prompts_file.is_file():
            raise ConfigError(f"--prompts-file {args.prompts_file} is not a file; give one prompt per line")
        prompts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompt: give at least one non-blank --prompt or a --prompts-file with one per line")
    check_checkpoint_layout(args.ckpt_path, args.tp)
    pc = ParallelContext(Layout(tp=args.tp, pp=args.pp))
    try:
        model, checkpoint = load_model(args.ckpt_path, pc)
        tokenizer = load_checkpoint_tokenizer(checkpoint)
        ids = [tokenizer.encode(prompt).ids for prompt in prompts]
        empty = [prompt for prompt, prompt_ids in zip(prompts, ids) if not prompt_ids]
        if empty:
            raise ConfigError(f"the prompt {empty[0]!r} encodes to no token with the checkpoint's tokenizer")
        completions = generate(model, pc, ids, args.max_new_tokens, sampling, eos_token_id(tokenizer),
                               model.config.vocab_size, use_cache=not args.no_cache)
        if pc.rank == 0:
            for prompt, completion in zip(prompts, completions):
                print(f"=== {prompt}\n{tokenizer.decode(completion)}\n", flush=True)
    finally:
        pc.destroy()


# The samplers that use each sampling option; with another sampler the option is refused, not silently ignored.
SAMPLING_OPTIONS = {"temperature": ("top-k", "top-p"), "top_k": ("top-k",), "top_p": ("top-p",)}


def _sampling(args: argparse.Namespace) -> SamplingArgs:
    """The ``SamplingArgs`` of ``generate``'s options (their defaults where not given)."""
    from nanotron.config import ConfigError
    from nanotron.generation.generate import SamplingArgs

    given = {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name) is not None}
    for name in given:
        if args.sampler not in SAMPLING_OPTIONS[name]:
            option = "--" + name.replace("_", "-")
            raise ConfigError(f"{option} does nothing with --sampler {args.sampler}; pass --sampler "
                              f"{' or '.join(SAMPLING_OPTIONS[name])} with it, or leave {option} out")
    return SamplingArgs(args.sampler, seed=args.seed, **given)


def _evaluate(args: argparse.Namespace) -> None:
    import json

    from nanotron.config import ConfigError, EvalTaskArgs
    from nanotron.files import atomic_write_text
    from nanotron.generation.evaluate import HFDatasetOptions, evaluate
    from nanotron.generation.generate import check_checkpoint_layout
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    if not args.data and not args.tasks:
        raise ConfigError("nothing to evaluate: give --data (held-out loss per source), --tasks (multiple-choice "
                          "tasks), or both")
    tasks = [EvalTaskArgs(path, num_fewshot=args.num_fewshot, fewshot_seed=args.fewshot_seed,
                          max_samples=args.max_samples, max_tokens=args.max_tokens) for path in args.tasks]
    check_checkpoint_layout(args.ckpt_path, args.tp, sequence_length=args.sequence_length,
                            sequence_key="--sequence-length")
    pc = ParallelContext(Layout(tp=args.tp, pp=args.pp))
    try:
        results = evaluate(args.ckpt_path, args.data, pc, args.sequence_length, args.max_windows, args.batch_size,
                           HFDatasetOptions(tuple(args.hf_dataset_splits), args.text_column_name), tasks)
        if pc.rank == 0:
            for name, result in results.items():
                if "acc" in result:
                    print(f"{name}: acc {result['acc']:.4f} | acc_norm {result['acc_norm']:.4f} | "
                          f"{result['examples']:,} examples")
                else:
                    print(f"{name}: loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | "
                          f"{result['tokens']:,} tokens")
            if args.output:
                atomic_write_text(args.output, json.dumps(results, indent=2))
    finally:
        pc.destroy()


def _convert(args: argparse.Namespace) -> None:
    from nanotron.checkpoint.hf import hf_to_nanotron, nanotron_to_hf

    if args.direction == "hf-to-nanotron":
        path = hf_to_nanotron(args.hf_path, args.save_path)
    else:
        path = nanotron_to_hf(args.ckpt_path, args.save_path)
    print(f"wrote {path}")


def _verify_checkpoint(args: argparse.Namespace) -> None:
    from nanotron.checkpoint.integrity import read_metadata, verify_checkpoint
    from nanotron.checkpoint.node_folders import NODE_RANKS, describe_ranks
    from nanotron.checkpoint.run_folder import resolve_checkpoint

    checkpoint = resolve_checkpoint(args.ckpt_path)
    metadata = read_metadata(checkpoint)
    verify_checkpoint(checkpoint, metadata)
    node = (f" (one node's folder: the files of ranks {describe_ranks(metadata[NODE_RANKS])})"
            if NODE_RANKS in metadata else "")
    print(f"{checkpoint}: step {metadata['step']}, {len(metadata['files'])} files{node}, sizes and checksums match")


def _plot(args: argparse.Namespace) -> None:
    from nanotron.plot import plot_runs

    print(f"wrote {plot_runs(args.metrics, args.output, args.smooth, args.names)}")


def _doremi_train(args: argparse.Namespace) -> None:
    _run_training(args, doremi_proxy=True)


def _doremi_average(args: argparse.Namespace) -> None:
    import json

    from nanotron.features.doremi_weights import average_weights
    from nanotron.files import atomic_write_text

    averaged = average_weights(args.history)
    if args.output is not None:
        atomic_write_text(args.output, json.dumps(averaged, indent=2) + "\n")
    print(f"domain_weights: [{', '.join(f'{weight:.6f}' for weight in averaged.values())}]  "
          f"# {', '.join(averaged)}")


def _estimate_memory(args: argparse.Namespace) -> None:
    from nanotron.config import load_config
    from nanotron.memory import estimate_memory, sharding_advice

    config = load_config(args.config_file, args.override)
    estimate = estimate_memory(config, args.gpu_memory_gb)
    print(estimate.table())
    advice = sharding_advice(config, estimate)
    if advice is not None:
        print(advice)


def _estimate(args: argparse.Namespace) -> None:
    from nanotron.config import ConfigError, load_config
    from nanotron.planning.cluster import CLUSTERS
    from nanotron.planning.search import candidate, parse_layout, ranked, table
    from nanotron.planning.step_time import compute_model, predict

    config = load_config(args.config_file, args.override)
    links = {key: value for key, value in (("gpus_per_node", args.gpus_per_node), ("intra_gb_s", args.nvlink_gb_s),
                                           ("inter_gb_s", args.ib_gb_s)) if value is not None}
    cluster = replace(CLUSTERS[args.cluster], **links)
    global_batch = args.global_batch_size or config.global_batch_size
    shape = (f"{config.model.model_config.__class__.__name__.removesuffix('Config')}, {global_batch} sequences x "
             f"{config.tokens.sequence_length} tokens per step, on {cluster.gpu.name} nodes of "
             f"{cluster.gpus_per_node}; compute from {compute_model(config, cluster).source}")
    if args.layout is not None:
        layout = parse_layout(args.layout, config, global_batch)
        if args.gpus is not None and args.gpus != layout.world_size:
            raise ConfigError(f"--layout {args.layout} uses {layout.world_size} GPUs, not --gpus {args.gpus}; "
                              "give one or make them agree")
        found = candidate(config, predict(config, layout, cluster), cluster.gpu.memory_gb)
        verdict = "fits" if found.memory_gb <= cluster.gpu.memory_gb else "does NOT fit"
        print(table([found], f"{shape}: {verdict} in {cluster.gpu.memory_gb:.1f} GB"))
        return
    if args.gpus is None:
        raise ConfigError("give --gpus N (rank the layouts of N GPUs) or --layout dp=...,tp=... (predict one)")
    found = ranked(config, args.gpus, cluster, args.top, global_batch)
    if not found:
        raise ConfigError(f"no layout of {args.gpus} GPUs fits {global_batch} sequences per step in "
                          f"{cluster.gpu.memory_gb:.1f} GB per GPU; try more GPUs, recomputation "
                          "(parallelism.recompute) or another --global-batch-size")
    print(table(found, f"{shape}: the {len(found)} fastest layouts of {args.gpus} GPUs that fit"))


def _schedule(args: argparse.Namespace) -> None:
    from nanotron.config import load_config
    from nanotron.layout import Layout

    timeline = Layout.from_config(load_config(args.config_file, args.override)).timeline()
    print(timeline.summary())
    print(timeline.render())


def _config_arguments(command: argparse.ArgumentParser, example: str | None = None) -> None:
    """A command that reads a config: ``--config-file`` and its ``--override`` values."""
    command.add_argument("--config-file", type=Path, required=True)
    command.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE",
                         help=f"change config values, e.g. {example}" if example else None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nanotron", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model from a YAML config (under torchrun for several ranks)")
    _config_arguments(train, "parallelism.tp=2 parallelism.tp_mode=REDUCE_SCATTER")
    train.set_defaults(run=_train)
    _add_data_commands(commands)
    _add_checkpoint_commands(commands)
    _add_run_commands(commands)
    return parser


def _add_data_commands(commands) -> None:
    from nanotron.data.tokenizer import MIN_VOCAB_SIZE

    pre = commands.add_parser("preprocess", help="tokenize .txt/.jsonl/.parquet files into training shards")
    pre.add_argument("--input", type=Path, nargs="+", required=True, help="files or directories")
    pre.add_argument("--tokenizer", required=True, help="tokenizer.json, a folder holding one, or a hub name")
    pre.add_argument("--output-folder", type=output_folder, required=True, help="a new or empty folder")
    pre.add_argument("--text-key", default="text", help="JSONL key / parquet column holding the text")
    pre.add_argument("--num-workers", type=at_least(1), default=None, help="processes (default: all cores)")
    pre.add_argument("--held-out-every", type=at_least(2), default=None, metavar="N",
                     help="with --split: every N-th document is held out (for evaluation), the others are for training")
    pre.add_argument("--split", choices=["train", "held-out"], default=None, help="which split to write")
    pre.set_defaults(run=_preprocess)

    tok = commands.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on local text")
    tok.add_argument("--input", type=Path, nargs="+", required=True, help="files or directories")
    tok.add_argument("--vocab-size", type=at_least(MIN_VOCAB_SIZE), required=True)
    tok.add_argument("--output", type=tokenizer_output, required=True,
                     help="a .json path or a folder (then its tokenizer.json); never an existing tokenizer")
    tok.add_argument("--text-key", default="text")
    tok.add_argument("--min-frequency", type=at_least(1), default=2)
    tok.set_defaults(run=_train_tokenizer)


def _add_checkpoint_commands(commands) -> None:
    gen = commands.add_parser("generate", help="generate text from a checkpoint (any --tp/--pp, under torchrun)")
    add_generate_arguments(gen)
    gen.set_defaults(run=_generate)

    evaluation = commands.add_parser(
        "eval", help="held-out loss and perplexity per data source, accuracy on multiple-choice tasks",
        description="Held-out loss and perplexity per data source, under plain causal attention over each window "
                    "(also for a checkpoint trained with _use_doc_masking: true): comparable with transformers'; "
                    "accuracy on local multiple-choice tasks, as the evals section scores them (docs/evals.md).")
    evaluation.add_argument("--ckpt-path", type=Path, required=True, help="a checkpoint, or a run folder (latest.txt)")
    evaluation.add_argument("--tasks", type=Path, nargs="+", default=[],
                            help="multiple-choice tasks: jsonl or parquet files, folders of them, save_to_disk "
                                 "folders (named by their stem)")
    evaluation.add_argument("--num-fewshot", type=at_least(0), default=0, help="solved examples before each question")
    evaluation.add_argument("--fewshot-seed", type=at_least(0), default=1234)
    evaluation.add_argument("--max-samples", type=at_least(1), default=None, help="the first examples of each task")
    evaluation.add_argument("--max-tokens", type=at_least(1), default=None, help="a token budget per task")
    evaluation.add_argument("--data", type=Path, nargs="+", default=[],
                            help="one source per domain, of any kind training reads: preprocessed or datatrove "
                                 "folders, Hugging Face datasets (save_to_disk folders, folders of data files, Hub "
                                 "names)")
    evaluation.add_argument("--hf-dataset-splits", nargs="+", default=["train"], metavar="SPLIT",
                            help="the splits read of a Hugging Face dataset, in order (default: train)")
    evaluation.add_argument("--text-column-name", default="text", help="a Hugging Face dataset's text column")
    evaluation.add_argument("--tp", type=at_least(1), default=1)
    evaluation.add_argument("--pp", type=at_least(1), default=1)
    evaluation.add_argument("--sequence-length", type=at_least(1), default=256)
    evaluation.add_argument("--max-windows", type=at_least(1), default=64,
                            help="windows read from the start of each source")
    evaluation.add_argument("--batch-size", type=at_least(1), default=8)
    evaluation.add_argument("--output", type=output_file(".json"),
                            help="also write the results as JSON (replaced if it exists)")
    evaluation.set_defaults(run=_evaluate)

    convert = commands.add_parser("convert", help="convert Llama, Qwen2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3 or Mamba "
                                                  "checkpoints to or from transformers (the family read from "
                                                  "config.json)")
    directions = convert.add_subparsers(dest="direction", required=True)
    to_nanotron = directions.add_parser("hf-to-nanotron",
                                        help="a Hugging Face model folder -> a nanotron checkpoint")
    to_nanotron.add_argument("--hf-path", type=Path, required=True)
    to_nanotron.add_argument("--save-path", type=output_folder, required=True, help="a new folder")
    to_hf = directions.add_parser("nanotron-to-hf",
                                  help="a nanotron checkpoint -> a Hugging Face model folder")
    to_hf.add_argument("--ckpt-path", type=Path, required=True, help="a checkpoint, or a run folder (latest.txt)")
    to_hf.add_argument("--save-path", type=output_folder, required=True,
                       help="a new or empty folder, or an earlier export (replaced)")
    convert.set_defaults(run=_convert)

    checkpoint = commands.add_parser("checkpoint", help="inspect checkpoints")
    actions = checkpoint.add_subparsers(dest="action", required=True)
    verify = actions.add_parser("verify", help="check every file of a checkpoint against its size and checksum")
    verify.add_argument("ckpt_path", type=Path, metavar="CKPT_PATH", help="a checkpoint, or a run folder (latest.txt)")
    verify.set_defaults(run=_verify_checkpoint)


def _add_run_commands(commands) -> None:
    from nanotron.plot import IMAGE_SUFFIXES

    plot = commands.add_parser("plot", help="draw loss, LR, grad-norm, throughput and MFU curves of runs to an image")
    plot.add_argument("--metrics", type=Path, nargs="+", required=True, help="metrics.jsonl files (or run folders)")
    plot.add_argument("--output", type=output_file(*IMAGE_SUFFIXES), required=True,
                      help=f"the image to write, in the format of its extension ({', '.join(IMAGE_SUFFIXES)}; "
                           "replaced if it exists)")
    plot.add_argument("--smooth", type=at_least(1), default=None, metavar="N",
                      help="also draw the loss averaged over N steps")
    plot.add_argument("--names", nargs="+", default=None, help="one label per run (default: the run folder names)")
    plot.set_defaults(run=_plot)

    doremi = commands.add_parser("doremi", help="DoReMi: train a proxy against a reference, average its weights")
    doremi_actions = doremi.add_subparsers(dest="action", required=True)
    proxy = doremi_actions.add_parser("train", help="train the proxy model (doremi.ref_model_resume_checkpoint_path)")
    _config_arguments(proxy)
    proxy.set_defaults(run=_doremi_train)
    average = doremi_actions.add_parser("average", help="the proxy's time-averaged domain weights, as a YAML line")
    average.add_argument("--history", type=Path, required=True, help="<checkpoints_path>/domain_weights.jsonl")
    average.add_argument("--output", type=output_file(".json"), default=None,
                         help="also write {name: weight} as JSON here (replaced if it exists)")
    average.set_defaults(run=_doremi_average)

    memory = commands.add_parser("estimate-memory",
                                 help="estimate each pipeline stage's GPU memory per rank, and the largest micro-batch")
    _config_arguments(memory, "parallelism.pp=2 tokens.micro_batch_size=8")
    memory.add_argument("--gpu-memory-gb", type=positive, default=None,
                        help="memory of one GPU (default: this machine's GPU, else an H200's 150.1)")
    memory.set_defaults(run=_estimate_memory)

    estimate = commands.add_parser("estimate", help="predict the step time of layouts on a cluster and rank those "
                                                    "that fit (docs/planning.md)")
    _config_arguments(estimate, "tokens.sequence_length=8192")
    estimate.add_argument("--gpus", type=at_least(1), default=None, help="rank the layouts of this many GPUs")
    estimate.add_argument("--layout", default=None, metavar="dp=N,tp=N,...",
                          help="predict one layout (keys dp, tp, pp, cp, ep, zero, schedule, mbs; others 1)")
    estimate.add_argument("--cluster", choices=["h100", "h200"], default="h100", help="the node preset")
    estimate.add_argument("--gpus-per-node", type=at_least(1), default=None, help="default 8")
    estimate.add_argument("--nvlink-gb-s", type=positive, default=None,
                          help="bus bandwidth of a collective inside a node (default 360)")
    estimate.add_argument("--ib-gb-s", type=positive, default=None,
                          help="bandwidth per GPU of a collective across nodes (default 45)")
    estimate.add_argument("--global-batch-size", type=at_least(1), default=None,
                          help="sequences per step (default: the config's)")
    estimate.add_argument("--top", type=at_least(1), default=10, help="layouts shown")
    estimate.set_defaults(run=_estimate)

    schedule = commands.add_parser("schedule", help="print the pipeline schedule's timeline: every stage's forwards "
                                                    "and backwards per chunk and micro-batch, and its bubble")
    _config_arguments(schedule, "parallelism.pp=4 parallelism.pp_engine=zb_h1")
    schedule.set_defaults(run=_schedule)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt-path", type=Path, required=True, help="a checkpoint, or a run folder (latest.txt)")
    parser.add_argument("--tp", type=at_least(1), default=1,
                        help="tensor-parallel size (the launcher starts tp*pp ranks)")
    parser.add_argument("--pp", type=at_least(1), default=1, help="pipeline-parallel size")
    parser.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    parser.add_argument("--prompts-file", type=Path, help="one prompt per line")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64)
    parser.add_argument("--sampler", choices=["greedy", "top-k", "top-p"], default="greedy")
    parser.add_argument("--temperature", type=positive, default=None,
                        help="divides the logits before sampling (top-k and top-p; default 1)")
    parser.add_argument("--top-k", type=at_least(1), default=None,
                        help="--sampler top-k draws from the k likeliest tokens (default 50)")
    parser.add_argument("--top-p", type=probability, default=None,
                        help="--sampler top-p draws from the likeliest tokens holding this share of the probability "
                             "(default 0.9; 1 keeps every token)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step")


# --- Option types: a value out of range or an output path that cannot be written stops the command line while it
# is parsed, before any data is read or model loaded, with argparse's "argument --name: problem" in one error line.


def at_least(minimum: int) -> Callable[[str], int]:
    """The type of a whole-number option of at least ``minimum``."""

    def whole_number(text: str) -> int:
        value = _number(int, text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value})")
        return value

    return whole_number


def positive(text: str) -> float:
    """The type of a number option above 0 (and finite)."""
    value = _number(float, text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number above 0 (got {text})")
    return value


def probability(text: str) -> float:
    """The type of a share of the probability mass: above 0, at most 1."""
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1 (got {text})")
    return value


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None


def output_file(*suffixes: str) -> Callable[[str], Path]:
    """The type of an output file's option: a path ending in one of ``suffixes`` where a file can be written
    (``files.output_problem``). An existing file there is replaced: the command writes results that it writes
    again when run again."""

    def writable_file(text: str) -> Path:
        path = _writable(Path(text))
        if path.suffix.lower() not in suffixes:
            listed = f"{', '.join(suffixes[:-1])} or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]
            raise argparse.ArgumentTypeError(f"{path} does not end in {listed}, the "
                                             f"format{'s' if len(suffixes) > 1 else ''} this command writes")
        return path

    return writable_file


def output_folder(text: str) -> Path:
    """The type of an output folder's option: a path where a folder can be written (``files.output_problem``);
    whether an existing folder may be used is the command's rule."""
    return _writable(Path(text), folder=True)


def tokenizer_output(text: str) -> Path:
    """``train-tokenizer --output``: a ``.json`` file or a folder for ``tokenizer.json``, never an existing
    tokenizer, which the folders preprocessed with it need as it is."""
    from nanotron.data.tokenizer import tokenizer_file

    path = tokenizer_file(Path(text))
    if path.is_file():
        raise argparse.ArgumentTypeError(f"{path} already exists, and data preprocessed with it needs it as it is; "
                                         "choose another path or delete it")
    _writable(path)
    return Path(text)


def _writable(path: Path, folder: bool = False) -> Path:
    from nanotron.files import output_problem

    problem = output_problem(path, folder)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}; choose another path")
    return path


class _Parser(argparse.ArgumentParser):
    """argparse reporting a bad command line as the library's user errors are reported, in one ``error:`` line
    with exit status 2, rather than with its usage block."""

    def error(self, message: str) -> NoReturn:
        _report_once(message)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except Exception as error:
        if not isinstance(error, _user_error_types()):
            raise
        _report_once(error)
        sys.exit(2)


# How long a rank other than 0 holds its report of an error back (seconds): long enough for rank 0, which usually
# met the same error, to print it first and exit, upon which the launcher stops this rank silently.
REPORT_GRACE_S = 10.0


def _report_once(error: Exception | str) -> None:
    """Print ``error`` once per job, and always at least once.

    Under a launcher every rank usually meets the same error (the same config, the same data). Rank 0 prints at
    once; any other rank waits ``REPORT_GRACE_S`` first. When rank 0 has printed and exited, torchrun stops the
    others before they print; when the error was this rank's alone, it still reaches the user. Exiting at once
    would let the launcher stop rank 0 before it printed: a failed job without an error line.
    """
    if os.environ.get("RANK", "0") != "0":
        time.sleep(REPORT_GRACE_S)
    print(f"error: {error}", file=sys.stderr, flush=True)


def _user_error_types() -> tuple[type[Exception], ...]:
    """Library errors meant for users carry their fix in the message; anything else keeps its traceback."""
    from nanotron.config import ConfigError
    from nanotron.data.dataset import DataError
    from nanotron.data.tokenizer import TokenizerError
    from nanotron.divergence import TrainingDivergedError
    from nanotron.errors import CheckpointError
    from nanotron.parallel.context import ParallelLayoutError
    from nanotron.parallel.data_parallel import ReplicaDivergenceError
    from nanotron.parallel.pipeline_parallel import PipelineTimeoutError
    from nanotron.plot import PlotError

    return (ConfigError, DataError, TokenizerError, CheckpointError, ParallelLayoutError,
            TrainingDivergedError, PipelineTimeoutError, ReplicaDivergenceError, PlotError)
