"""What a checkpoint records of the data stages, and how a resume holds the config's data stages against it.

A stage's sample ``g`` is a pure function of the stage's seed, the sequence length, its domains' windows and the blend
(``data/dataset.py``); ``consumed_samples`` says where each stage's stream resumes. checkpoint.json's
``data_stages`` records, per stage name, its start step and what its order depends on::

    {"start_training_step": 1, "seed": 42, "sequence_length": 2048, "weights": [0.3, 0.7],
     "domains": [{"source": "/data/code", "windows": 120345}, {"source": "/data/web", "windows": 991020}]}

``windows`` is a domain's count of samples per epoch: its content as the order sees it (a domain whose files
changed has another count; a folder moved to another path keeps its order). Synthetic tokens are one domain
without windows.

At a resume, before the model is built:

1. Each stage of the checkpoint that consumed samples continues the stage of ``data_stages`` of its name. One whose
   name ``data_stages`` lacks continues the stage at its position instead, where both list the same start steps
   (a renamed stage: v0.4's ``data`` section is the stage ``main``), with a warning naming both names. Where a stage
   that has started by the checkpoint's step would instead start over at sample 0, the resume is refused in one line
   naming both stages and the fix; a checkpoint's stage that no stage continues is otherwise kept in its count.
2. Each continued stage's order is compared with its record: each change (seed, sequence length, domains, weights)
   is one warning saying what changed and that the stage continues at its position in the new order, so samples
   already trained on may come again and others are skipped. A checkpoint without the record (written by an earlier
   version) resumes with one note saying that changes cannot be named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from nanotron.config import Config, ConfigError, DatasetStageArgs
from nanotron.data.dataset import SampleSource

DATA_STAGES = "data_stages"  # the checkpoint.json key


def data_stages_record(config: Config, datasets: dict[str, SampleSource]) -> dict[str, dict]:
    """checkpoint.json's ``data_stages``: each stage's start step and what defines its sample order."""
    return {stage.name: _stage_record(stage, datasets[stage.name]) for stage in config.data_stages}


def _stage_record(stage: DatasetStageArgs, dataset: SampleSource) -> dict:
    record = {"start_training_step": stage.start_training_step, "seed": stage.data.seed,
              "sequence_length": dataset.sequence_length, "weights": list(dataset.weights)}
    if dataset.num_windows is None:  # an endless stream: synthetic tokens
        return record | {"domains": [{"source": source, "windows": None} for source in dataset.domain_sources]}
    return record | {"window_stride": dataset.window_stride,
                     "domains": [{"source": source, "windows": windows}
                                 for source, windows in zip(dataset.domain_sources, dataset.num_windows)]}


@dataclass
class DataPosition:
    """Where each data stage of the config resumes (``consumed_samples``, keyed by the config's names, with the
    counts of checkpoint stages that no stage continues) and the lines to log about it."""

    consumed_samples: dict[str, int]
    notes: list[str]


def resumed_data_position(checkpoint: Path, metadata: dict, config: Config, current: dict[str, dict]) -> DataPosition:
    """The data position of ``config``'s stages (``current``: their ``data_stages_record``) resumed from
    ``checkpoint`` (its ``metadata``), and a line for each renamed stage and each change of a stage's sample order;
    raises ConfigError where a stage would start over."""
    consumed, notes, continued = _matched_stages(checkpoint, metadata, config)
    records = metadata.get(DATA_STAGES)
    if records is None:
        if any(consumed.values()):
            notes.append(f"{checkpoint} records no sample order of its data stages (saved by an earlier version): "
                         "a change of their data since then cannot be named")
        return DataPosition(consumed, notes)
    for old, new in continued.items():
        if old not in records:
            continue
        notes += [f"data stage {new!r}: {change}; it continues at sample {consumed[new]} of the new order, so "
                  "samples already trained on may come again and others be skipped"
                  for change in _order_changes(records[old], current[new])]
    return DataPosition(consumed, notes)


def _matched_stages(checkpoint: Path, metadata: dict,
                    config: Config) -> tuple[dict[str, int], list[str], dict[str, str]]:
    """The consumed samples keyed by the config's stage names, the lines about renamed stages, and which stage of
    the config continues each checkpoint stage that consumed samples (old name -> new name)."""
    counts = metadata["consumed_samples"]
    consumed = {name: count for name, count in counts.items() if count}
    names = [stage.name for stage in config.data_stages]
    continued = {name: name for name in consumed if name in names}
    notes = []
    renamed = _renamed_stages(checkpoint, metadata, config, consumed)
    for old, new in renamed.items():
        notes.append(f"data stage {old!r} of {checkpoint} is {new!r} in data_stages (the same position and start "
                     f"step): {new!r} continues its {consumed[old]} consumed samples")
    continued |= renamed
    restarted = [stage for stage in config.data_stages
                 if stage.start_training_step <= metadata["step"] and stage.name not in continued.values()]
    dropped = [name for name in consumed if name not in continued]
    if restarted and dropped:
        raise ConfigError(_restart_problem(checkpoint, metadata, config, restarted[0], dropped[0]))
    for name in dropped:
        notes.append(f"data stage {name!r} of {checkpoint} ({consumed[name]} samples consumed) is not in "
                     "data_stages: no stage continues it, and its count is kept in later checkpoints")
    position = {name: count for name, count in counts.items() if name not in renamed}
    return position | {new: counts[old] for old, new in renamed.items()}, notes, continued


def _renamed_stages(checkpoint: Path, metadata: dict, config: Config, consumed: dict[str, int]) -> dict[str, str]:
    """Checkpoint stages that consumed samples under a name ``data_stages`` lacks, continued by the stage at their
    position: where the checkpoint's stages and the config's have the same start steps, and the config's stage at
    that step has a name the checkpoint never consumed under (old name -> new name)."""
    names = {stage.name for stage in config.data_stages}
    saved = _saved_stages(checkpoint, metadata)
    current = {stage.start_training_step: stage.name for stage in config.data_stages}
    if saved is None or sorted(saved.values()) != sorted(current):
        return {}
    return {old: current[start] for old, start in saved.items()
            if old in consumed and old not in names and current[start] not in consumed}


def _saved_stages(checkpoint: Path, metadata: dict) -> dict[str, int] | None:
    """The start step of each stage of the run that saved ``checkpoint``: from its record, or for a checkpoint of an
    earlier version from its config.yaml; None if neither can be read."""
    records = metadata.get(DATA_STAGES)
    if records is not None:
        return {name: record["start_training_step"] for name, record in records.items()}
    try:
        stages = yaml.safe_load((checkpoint / "config.yaml").read_text(encoding="utf-8"))["data_stages"]
        return {stage["name"]: int(stage["start_training_step"]) for stage in stages}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def _restart_problem(checkpoint: Path, metadata: dict, config: Config, stage: DatasetStageArgs, old: str) -> str:
    saved = _saved_stages(checkpoint, metadata) or {}
    old_start = f" (from step {saved[old]})" if old in saved else ""
    index = config.data_stages.index(stage)
    return (f"data stage {stage.name!r} (from step {stage.start_training_step}) has no position in {checkpoint}, "
            f"which consumed {metadata['consumed_samples'][old]} samples of data stage {old!r}{old_start}: resumed, "
            f"{stage.name!r} would start over at sample 0. If it is that stage renamed, name it {old!r} again "
            f"(e.g. --override data_stages.{index}.name={old}), or give data_stages the checkpoint's start steps")


def _order_changes(saved: dict, current: dict) -> list[str]:
    """What changed in a stage's sample order between its record in a checkpoint and now, one phrase per change."""
    changes = []
    if saved["seed"] != current["seed"]:
        changes.append(f"data.seed {saved['seed']} is now {current['seed']}: its domains are walked in another order")
    if saved["sequence_length"] != current["sequence_length"]:
        return changes + [f"tokens.sequence_length {saved['sequence_length']} is now {current['sequence_length']}: "
                          "its samples are cut anew, at the new length"]
    old, new = saved["domains"], current["domains"]
    if [domain["windows"] for domain in old] != [domain["windows"] for domain in new]:
        return changes + _domain_changes(old, new)
    if saved["weights"] != current["weights"]:
        changes.append(f"its blend weights {_shares(saved['weights'])} are now {_shares(current['weights'])}: the "
                       "blend's slots are recomputed")
    return changes


def _domain_changes(old: list[dict], new: list[dict]) -> list[str]:
    before = {domain["source"]: domain["windows"] for domain in old}
    after = {domain["source"]: domain["windows"] for domain in new}
    changes = [f"{source} was added" for source in after if source not in before]
    changes += [f"{source} was removed" for source in before if source not in after]
    changes += [f"{source} holds {after[source]} samples per epoch, {before[source]} before (its files changed)"
                for source in after if source in before and after[source] != before[source]]
    # The same sources and sizes in another order: each domain's slots in the blend change.
    return [f"{change}: the blend and the domains' orders are recomputed" for change in changes] or [
        "its domains are listed in another order: the blend is recomputed"]


def _shares(weights: list[float]) -> str:
    return "[" + ", ".join(f"{weight:.4g}" for weight in weights) + "]"
