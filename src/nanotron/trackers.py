"""Experiment trackers: every step record of metrics.jsonl also goes to TensorBoard and/or Weights & Biases.

Both are optional extras (``pip install -e ".[tensorboard]"`` / ``".[wandb]"``); the config check refuses a tracker
whose package is missing before anything is built. Only rank 0 writes, as it does metrics.jsonl, and it writes the
same fields: numbers as scalars named after their metrics.jsonl key (``domain_losses`` as ``domain_loss/<name>``),
plus the resolved config (TensorBoard: as YAML text; W&B: as the run's config). W&B's ``offline`` mode writes the run
locally with no network, for ``wandb sync`` later.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from nanotron.config import Config, config_to_dict


def scalars(record: dict) -> dict[str, float]:
    """The numeric fields of a step record, nested per-domain losses flattened, ``step`` left out."""
    flat = {}
    for key, value in record.items():
        if key == "domain_losses":
            flat |= {f"domain_loss/{name}": float(loss) for name, loss in value.items()}
        elif key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


class Trackers:
    def __init__(self, config: Config):
        logging = config.logging
        resolved = config_to_dict(config)
        self.tensorboard = self.wandb = None
        if logging.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(logging.tensorboard_dir))
            self.tensorboard.add_text("config", "```\n" + yaml.safe_dump(resolved, sort_keys=False) + "\n```")
        if logging.wandb is not None:
            import wandb

            args = logging.wandb
            directory = Path(args.dir or config.checkpoints.checkpoints_path)
            directory.mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(project=args.project, entity=args.entity, mode=args.mode,
                                    name=args.name or config.general.run, dir=str(directory), config=resolved)

    def log(self, record: dict) -> None:
        values = scalars(record)
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(values, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
