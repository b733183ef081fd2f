"""Same weights, same batches, same curve: nanotron and its peers trained from nanotron's initial weights.

    python scripts/benchmark_curve.py --data work/data/tokenized --steps 100 --peer hf torchtitan

The speed records are only fair if every system computes the same training. This trains nanotron for ``--steps``
steps on fresh batches, exports its initial weights through its Hugging Face adapter, loads them into each peer
(``transformers`` directly, torchtitan through its own Hugging Face adapter), and trains each peer on the same
batches with the same AdamW settings (betas, epsilon, clipping at the config's ``clip_grad``, nanotron's learning
rate at every step, no weight decay in any system), recording every step's loss and gradient norm. The peers keep
their own precision: ``hf`` trains bf16 weights with bf16 optimizer state, ``hf-amp`` and torchtitan fp32 weights
under bf16 autocast, nanotron bf16 weights with fp32 masters. The record (``benchmarks/results/curves/``) holds the
curves and, per peer, the largest and the mean loss difference from nanotron's curve over the steps after the first
tenth.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from pathlib import Path

import torch
from benchmark import PRESETS, nanotron_config
from benchmark_peers import LIBRARIES, PEERS, build_peer, peer_problem
from benchmark_record import RESULTS, command_line, git_commit, installed_versions, write_record

ROOT = Path(__file__).resolve().parents[1]
CURVE_PEERS = ("hf", "hf-eager", "hf-amp", "liger", "torchtitan")
# The model-config fields a peer is built from (``benchmark_peers``), read from the config nanotron trains.
PEER_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a preprocessed folder (token ids < the vocabulary)")
    parser.add_argument("--preset", choices=sorted(name for name in PRESETS if name.startswith("llama")),
                        default="llama1b")
    parser.add_argument("--peer", nargs="+", choices=CURVE_PEERS, default=["hf", "torchtitan"])
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--override", nargs="*", default=[], help="nanotron config overrides (section.key=value)")
    parser.add_argument("--name", help="the record's name (default: <preset>-curve)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS / "curves")
    parser.add_argument("--commit", help="the measured code's commit, for a copy of the tree without git metadata")
    args = parser.parse_args(argv)
    args.warmup, args.save_to = 0, None  # what nanotron_config reads besides
    return args


def nanotron_curve(args, device: str) -> tuple[dict, dict, dict[str, torch.Tensor], list, list[float], float]:
    """nanotron's curve, with what the peers start from: the model fields, the initial weights in Hugging Face
    names, every step's batch, every step's learning rate and the clipping norm."""
    from nanotron.models.registry import spec_for_config
    from nanotron.optim.lr_schedule import learning_rate_at
    from nanotron.trainer import Trainer

    trainer = Trainer(nanotron_config(args, args.preset, ["optimizer.weight_decay=0.0", *args.override]))
    config, model_config = trainer.config, trainer.config.model.model_config
    fields = {name: getattr(model_config, name) for name in PEER_FIELDS}
    vocab, padded = model_config.vocab_size, trainer.model.padded_vocab_size

    def read(name: str) -> torch.Tensor:  # the logical tensor, its vocabulary rows unpadded (as an export writes)
        tensor = trainer.params[name].detach()
        return (tensor[:vocab] if tensor.shape[0] == padded != vocab else tensor).clone()

    initial = spec_for_config(model_config).hf_adapter.weights_to_hf(read, model_config)
    loader = trainer.loader(config.data_stages[0])
    batches = [loader.next_step() for _ in range(args.steps)]
    schedule = config.optimizer.learning_rate_scheduler
    rates = [learning_rate_at(i + 1, schedule, config.tokens.train_steps) for i in range(args.steps)]
    losses, norms = [], []
    for batch, lr in zip(batches, rates, strict=True):
        result = trainer.finish_step(trainer.train_step(batch, lr))
        losses.append(result.loss)
        norms.append(result.grad_norm)
    optimizer = config.optimizer
    settings = {"betas": (optimizer.adam_beta1, optimizer.adam_beta2), "eps": optimizer.adam_eps,
                "clip_grad": optimizer.clip_grad, "learning_rates": rates, "weight_decay": 0.0}
    trainer.close()
    return {"losses": losses, "grad_norms": norms}, fields, initial, batches, rates, settings


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model``'s parameters by name (compiled blocks' ``_orig_mod`` left out); every
    parameter must be given, tied ones once."""
    params = {name.replace("._orig_mod", ""): p for name, p in model.named_parameters()}
    if set(params) != set(weights):
        raise ValueError(f"the exported weights do not match the peer's parameters: missing "
                         f"{sorted(set(params) - set(weights))}, unknown {sorted(set(weights) - set(params))}")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].device))


def peer_weights(peer: str, loop, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The initial weights in the peer's own names: torchtitan converts Hugging Face names with its adapter."""
    if peer != "torchtitan":
        return initial
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(loop.model.model_args, None).from_hf(initial)


def peer_curve(peer: str, fields: dict, initial: dict[str, torch.Tensor], batches: list, settings: dict,
               sequence_length: int, device: str) -> dict:
    """``peer`` trained from ``initial`` on ``batches`` with nanotron's optimizer settings."""
    loop = build_peer(peer, fields, sequence_length, device)
    try:
        load_weights(loop.model, peer_weights(peer, loop, initial))
        optimizers = getattr(loop.optimizer, "optimizers", [loop.optimizer])  # torchtitan's container
        for group in (group for optimizer in optimizers for group in optimizer.param_groups):
            group.update(betas=settings["betas"], eps=settings["eps"], weight_decay=settings["weight_decay"])
        losses, norms = [], []
        for batch, lr in zip(batches, settings["learning_rates"], strict=True):
            loss = torch.zeros((), device=device)
            for micro_batch in batch:
                part = loop.loss_of({"input_ids": micro_batch.input_ids.to(device),
                                     "labels": micro_batch.labels.to(device)}) / len(batch)
                part.backward()
                loss += part.detach().float()
            norm = torch.nn.utils.clip_grad_norm_(loop.parameters, settings["clip_grad"] or float("inf"))
            for group in (group for optimizer in optimizers for group in optimizer.param_groups):
                group["lr"] = lr
            loop.optimizer.step()
            loop.optimizer.zero_grad(set_to_none=True)
            losses.append(loss)
            norms.append(norm.float())
        return {"losses": torch.stack(losses).tolist(), "grad_norms": torch.stack(norms).tolist()}
    finally:
        loop.restore()


def differences(reference: list[float], losses: list[float]) -> dict:
    """How far ``losses`` run from ``reference`` after the first tenth of the steps (where both fall fastest)."""
    start = len(reference) // 10
    gaps = [b - a for a, b in zip(reference[start:], losses[start:], strict=True)]
    return {"max_abs_loss_difference": max(abs(g) for g in gaps), "mean_loss_difference": sum(gaps) / len(gaps),
            "first_loss_difference": losses[0] - reference[0]}


def curves(args, device: str) -> dict:
    """Every system's curve and each peer's differences from nanotron's."""
    ours, fields, initial, batches, _, settings = nanotron_curve(args, device)
    systems = {"nanotron": ours}
    for peer in args.peer:
        if device == "cuda":
            torch.cuda.empty_cache()
        systems[PEERS[peer]] = peer_curve(peer, fields, initial, batches, settings, args.sequence_length, device)
    return {"systems": systems, "model": fields, "optimizer": {k: v for k, v in settings.items()
                                                              if k != "learning_rates"},
            "learning_rates": settings["learning_rates"],
            "differences": {name: differences(ours["losses"], system["losses"])
                            for name, system in systems.items() if name != "nanotron"}}


def main(argv: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else argv
    args = parse_args(arguments)
    problem = next((p for p in (peer_problem(peer, args.preset, PRESETS[args.preset]) for peer in args.peer) if p),
                   None)
    commit = (args.commit, False) if args.commit else git_commit(ROOT)
    if commit is None:
        problem = f"{ROOT} is not a git checkout: pass --commit with the measured code's commit"
    if problem is None and not torch.cuda.is_available():
        problem = "the curves are measured on a CUDA device"
    if problem is not None:
        sys.exit(f"error: {problem}")
    result = curves(args, "cuda")
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"date": now.date().isoformat(), "recorded_at": now.isoformat(timespec="seconds"),
              "preset": args.preset, "gpu": torch.cuda.get_device_name(), "commit": commit[0], "dirty": commit[1],
              "torch": torch.__version__, "versions": installed_versions(LIBRARIES),
              "command": command_line([Path(__file__).resolve().relative_to(ROOT).as_posix(), *arguments], {}),
              "sequence_length": args.sequence_length, "micro_batch_size": args.micro_batch_size,
              "accumulation": args.accumulation, "steps": args.steps, "overrides": args.override} | result
    path = write_record(record, args.results_dir, args.name or f"{args.preset}-curve")
    for name, gaps in result["differences"].items():
        print(f"{name}: loss difference from nanotron after step {args.steps // 10}: max "
              f"{gaps['max_abs_loss_difference']:.4f}, mean {gaps['mean_loss_difference']:+.4f}; first step "
              f"{gaps['first_loss_difference']:+.2e}")
    print(f"record: {path}")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # as scripts/benchmark.py: the trainer's workers would keep the interpreter from exiting
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
