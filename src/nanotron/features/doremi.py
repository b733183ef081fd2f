"""DoReMi as features: the domain mixture of any run with a ``doremi`` section (``DomainMixture``: the reference run
samples by ``doremi.domain_weights``), and the proxy's training (``DoReMiProxy``, ``nanotron doremi train``): a
frozen reference model, weighted domain losses and domain weights that change every step
(``features/doremi_weights.py``).

Every step, on the same global batch at any layout:

1. the batch is drawn uniformly over the domains (or by ``dataset_weights``), as in any run, so that every domain
   is in every batch and has its excess loss measured: drawing batches by the learned weights instead let one
   domain take whole batches within 200 steps on the demo corpus, after which the others were never measured
   again and their weights could not recover;
2. the reference model (any checkpoint: it is rebuilt at this run's tp/pp, without autograd) gives every token's
   loss ``ℓ_ref``;
3. the proxy minimises ``Σ_i α_i · mean loss of domain i`` (the DRO objective): the language-model loss with each
   target token weighted by its domain's ``α_i`` over the domain's tokens in the global batch
   (``MicroBatch.sample_weights``), whose counts are summed over data-parallel ranks first, so the gradients do not
   depend on the split over ranks and micro-batches;
4. the per-domain sums of ``max(ℓ - ℓ_ref, 0)`` (the step term ``ExcessLoss``) and token counts travel as step
   statistics (summed over micro-batches, stages and data-parallel ranks), and update ``α`` for the next step.

The weights are saved in every checkpoint (``domain_weights``, by domain name), so a resumed run continues the
same trajectory, each domain with its own weight whatever the order of its folders now; the weights of every step
go to ``domain_weights.jsonl`` in ``checkpoints_path`` and to metrics.jsonl.
"""

from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from nanotron.checkpoint.integrity import read_metadata
from nanotron.checkpoint.manager import checkpoint_model
from nanotron.checkpoint.run_folder import resolve_checkpoint
from nanotron.config import Config, ConfigError, DatasetArgs, DatasetStageArgs, DoReMiArgs, HFDatasetArgs, load_config
from nanotron.data.batch import MicroBatch
from nanotron.data.dataset import unique_domain_names
from nanotron.errors import CheckpointError
from nanotron.features.doremi_weights import HISTORY_FILE, WeightHistory, updated_weights
from nanotron.generation.generate import forward_logits, load_model
from nanotron.layout import Group
from nanotron.models.registry import spec_named
from nanotron.models.spec import ModelSpec
from nanotron.parallel.cross_entropy import vocab_parallel_token_losses
from nanotron.parallel.statistics import Statistics
from nanotron.training.hooks import Feature, Run
from nanotron.training.objective import StageOutputs, per_domain_sums


def reference_checkpoint(config: Config) -> Path:
    """The reference model's checkpoint, checked before anything is allocated: present, of the same vocabulary, and
    with a decoder layer for each of the proxy's model chunks."""
    if config.doremi is None or config.doremi.ref_model_resume_checkpoint_path is None:
        raise ConfigError("doremi.ref_model_resume_checkpoint_path is not set; point it at the reference model "
                          "trained with examples/doremi/train_reference.py")
    if len(config.data_stages) != 1:
        raise ConfigError(f"DoReMi proxy training takes one data stage (its domains); data_stages has "
                          f"{len(config.data_stages)}")
    path = Path(config.doremi.ref_model_resume_checkpoint_path)
    if not path.exists():
        raise ConfigError(f"doremi.ref_model_resume_checkpoint_path {path} does not exist; train the reference "
                          "first (examples/doremi/train_reference.py) or fix the path")
    checkpoint = resolve_checkpoint(path)
    metadata = read_metadata(checkpoint)
    model = metadata["model"]
    proxy = config.model.model_config
    if model["vocab_size"] != proxy.vocab_size:
        raise ConfigError(f"the reference {checkpoint} has a vocabulary of {model['vocab_size']} but "
                          f"model.model_config.vocab_size is {proxy.vocab_size}: reference and proxy must share a "
                          "tokenizer")
    problem = _reference_chunk_problem(config, checkpoint, metadata)
    if problem is not None:
        raise ConfigError(problem)
    if proxy.document_masking and not _masks_documents(spec_named(model["type"], checkpoint)):
        raise ConfigError(f"model.model_config._use_doc_masking is true, but the reference {checkpoint} is a "
                          f"{model['type']} model, which cannot keep each document apart: its losses would not be "
                          "those of the documents the proxy reads; train an attention-family reference, or set "
                          "_use_doc_masking: false")
    return checkpoint


def _reference_chunk_problem(config: Config, checkpoint: Path, metadata: dict) -> str | None:
    """The reference is split into the proxy's pipeline chunks (``load_model`` at the run's layout): it needs a
    decoder layer per chunk."""
    p = config.parallelism
    chunks = p.pp * p.virtual_pipeline_size
    _, reference = checkpoint_model(checkpoint, metadata)
    if reference.num_hidden_layers >= chunks:
        return None
    return (f"the reference {checkpoint} has {reference.num_hidden_layers} decoder layers, fewer than the proxy's "
            f"parallelism.pp x virtual_pipeline_size ({p.pp} x {p.virtual_pipeline_size}) model chunks, over which "
            f"it runs as the proxy does; lower pp or virtual_pipeline_size, or train a reference of at least {chunks} "
            "layers")


def _masks_documents(spec: ModelSpec) -> bool:
    """Whether the family's model takes ``document_ids`` (attention families; a state-space model reads on)."""
    return "document_ids" in inspect.signature(spec.model_class.forward).parameters


_DOMAIN_NAMING = ("named by doremi.domain_names, else by the folders of data_stages[0].data.dataset.dataset_folder "
                  "or its hf_dataset_or_datasets")


def domain_names(config: Config) -> list[str]:
    """The names of a DoReMi run's domains, which key its weights: ``doremi.domain_names``, else the names of what
    its data stage reads, folders or Hugging Face datasets (``unique_domain_names``); two domains given the same
    name are refused."""
    doremi = config.doremi
    names = list(doremi.domain_names) if doremi is not None and doremi.domain_names is not None else (
        unique_domain_names(_domain_sources(config.data_stages[0].data.dataset)))
    repeated = [name for name, count in Counter(names).items() if count > 1]
    if repeated:
        raise ConfigError(f"DoReMi keys its weights by domain name, and {', '.join(map(repr, repeated))} names "
                          f"several domains ({_DOMAIN_NAMING}); give each its own name in doremi.domain_names")
    return names


def _domain_sources(dataset: DatasetArgs | HFDatasetArgs | None) -> list[str | Path]:
    """What each domain of a data stage is read from: its folders, or its Hugging Face datasets."""
    if isinstance(dataset, HFDatasetArgs):
        datasets = dataset.hf_dataset_or_datasets
        return list(datasets) if isinstance(datasets, dict) else [datasets]
    if dataset is None:
        raise ConfigError("DoReMi's proxy reads its domains from data_stages[0].data.dataset, which is null "
                          "(synthetic tokens); give it the domains' folders or Hugging Face datasets")
    return dataset.dataset_folder


def saved_weights(checkpoint: Path, metadata: dict, names: list[str]) -> list[float] | None:
    """The weights a proxy checkpoint saved, in the order of this run's domains ``names`` (None if it has none).

    They are saved by domain name; a checkpoint written before that holds a list in the order of its own domains,
    which its config.yaml names. Either way, a domain added, removed or renamed since is refused: a weight is never
    carried over to another domain.
    """
    saved = metadata.get("domain_weights")
    if saved is None:
        return None
    if isinstance(saved, list):
        try:
            saved_names = domain_names(load_config(checkpoint / "config.yaml"))
        except ConfigError as error:
            raise CheckpointError(f"{checkpoint} holds its DoReMi weights as a list, in the order of the domains of "
                                  f"its config.yaml, which does not tell them: {error}") from None
        if len(saved_names) != len(saved):
            raise CheckpointError(f"{checkpoint} holds {len(saved)} DoReMi weights but its config.yaml names "
                                  f"{len(saved_names)} domains; the checkpoint is inconsistent")
        saved = dict(zip(saved_names, saved))
    if not (isinstance(saved, dict) and all(isinstance(weight, (int, float)) for weight in saved.values())):
        raise CheckpointError(f"{checkpoint}: domain_weights in checkpoint.json is not a mapping of domain names to "
                              f"numbers (got {str(saved)[:80]})")
    if set(saved) != set(names):
        new, gone = [name for name in names if name not in saved], [name for name in saved if name not in names]
        raise ConfigError(
            f"{checkpoint} holds DoReMi weights for the domains {', '.join(saved)} but this run has "
            f"{', '.join(names)} ({_DOMAIN_NAMING})" + (f"; new: {', '.join(new)}" if new else "")
            + (f"; gone: {', '.join(gone)}" if gone else "") + ". The weights follow the domain names: resume on "
            "the same domains (in any order), or start the proxy over in another checkpoints.checkpoints_path")
    return [float(saved[name]) for name in names]


def excess_loss_sums(losses: torch.Tensor, batch: MicroBatch, num_domains: int) -> torch.Tensor:
    """Each domain's sum of the token losses' excess over the reference model's (clamped at 0, masked tokens out)."""
    excess = (losses.detach() - batch.extras["reference_losses"]).clamp(min=0.0)
    return per_domain_sums(torch.where(batch.label_mask, excess, 0.0).sum(-1), batch.domain_ids, num_domains)


class ExcessLoss:
    """The proxy's step term (``training/objective.py``): on the last stage, each domain's sum of the token losses'
    excess over the reference's (``excess_loss_sum``), which the domain weights follow (``after_step``)."""

    def __init__(self, num_domains: int):
        self.num_domains = num_domains

    def template(self) -> dict[str, tuple[int, ...]]:
        return {"excess_loss_sum": (self.num_domains,)}

    def compute(self, stage: StageOutputs, batch: MicroBatch) -> tuple[torch.Tensor | None, Statistics]:
        if not stage.last:
            return None, {}
        return None, {"excess_loss_sum": excess_loss_sums(stage.token_losses, batch, self.num_domains)}

    def metrics(self, sums: Statistics) -> dict:
        return {}


class DomainMixture(Feature):
    """A run with a ``doremi`` section: its domains are named by ``doremi.domain_names`` and, unless
    ``dataset_weights`` say otherwise, sampled by ``doremi.domain_weights`` (the reference run's fixed mixture)."""

    def __init__(self, args: DoReMiArgs):
        self.args = args

    def sampling_weights(self, stage: DatasetStageArgs, weights: list[float] | None) -> list[float] | None:
        return weights if weights is not None else self.args.domain_weights

    def domain_names(self, stage: DatasetStageArgs, names: list[str]) -> list[str]:
        return list(self.args.domain_names) if self.args.domain_names is not None else names


class DoReMiProxy(DomainMixture):
    """Trains the proxy model of a DoReMi run (``doremi`` section with a reference checkpoint): the reference and the
    domains are checked when the feature is made, before anything is allocated."""

    def __init__(self, config: Config):
        super().__init__(config.doremi)
        self.reference_checkpoint = reference_checkpoint(config)
        self.names = domain_names(config)
        self.weights = self.used = None
        self.resumed_weights = None  # set by load_state_dict when resuming from a proxy checkpoint
        self.history = None

    def sampling_weights(self, stage: DatasetStageArgs, weights: list[float] | None) -> list[float]:
        """Uniform over the domains unless ``dataset_weights`` say otherwise: ``doremi.domain_weights`` are the
        proxy's starting loss weights, not its sampling mixture."""
        return weights or [1.0] * len(self.names)

    def step_terms(self) -> list[ExcessLoss]:
        return [ExcessLoss(len(self.names))]

    def load_state_dict(self, checkpoint: Path, metadata: dict) -> None:
        """Checks, before the model is built, that a proxy checkpoint's weights are for this run's domains."""
        self.resumed_weights = saved_weights(checkpoint, metadata, self.names)

    def start(self, run: Run) -> None:
        self.pc = run.pc
        self.reference, _ = load_model(self.reference_checkpoint, self.pc)
        self.reference.requires_grad_(False)
        if self.resumed_weights is not None:
            self.weights = self.resumed_weights
        elif self.args.domain_weights is not None:
            self.weights = list(self.args.domain_weights)
        else:
            self.weights = [1.0 / len(self.names)] * len(self.names)
        if self.pc.rank == 0:
            self.history = WeightHistory(run.folder / HISTORY_FILE, run.progress.step)

    @torch.no_grad()
    def _reference_losses(self, batch: MicroBatch) -> torch.Tensor | None:
        """The reference's token losses on the micro-batch, read as the proxy's forward reads it: under document
        masking with the same per-document positions and documents, so that the excess losses compare like with
        like."""
        logits = forward_logits(self.reference, self.pc, batch.input_ids, batch.position_ids, None, None,
                                last_only=False, gather=False, document_ids=batch.document_ids)
        if logits is None:  # not the last pipeline stage
            return None
        return vocab_parallel_token_losses(logits, batch.labels, self.pc.group(Group.TP),
                                           self.reference.config.vocab_size)

    def before_forward_backward(self, micro_batches: list[MicroBatch]) -> None:
        """Each micro-batch also carries its reference losses and the weight in the objective of each of its samples'
        target tokens (``sample_weights``): ``α_i`` over domain ``i``'s token count in the global batch."""
        tokens = sum(per_domain_sums(mb.label_mask.sum(-1).float(), mb.domain_ids, len(self.names))
                     for mb in micro_batches)
        dist.all_reduce(tokens, group=self.pc.group(Group.SAMPLE_SHARDS))
        weights = torch.tensor(self.weights, device=self.pc.device, dtype=torch.float32)
        per_token = torch.where(tokens > 0, weights / tokens.clamp(min=1.0), 0.0)
        for mb in micro_batches:
            mb.sample_weights = per_token[mb.domain_ids]
            reference = self._reference_losses(mb)
            if reference is not None:
                mb.extras["reference_losses"] = reference

    def after_step(self, step: int, statistics: Statistics, skipped: bool) -> None:
        """The weights of the next step (a skipped step keeps them); the history records the ones this step used."""
        self.used = self.weights
        if not skipped:
            self.weights = updated_weights(self.used, statistics["excess_loss_sum"].tolist(),
                                           statistics["domain_tokens"].tolist(), self.args.step_size,
                                           self.args.smoothing_param)
        if self.history is not None:
            self.history.write(step, self.names, self.used)

    def metrics(self) -> dict:
        return {"domain_weights": dict(zip(self.names, self.used))}

    def state_dict(self) -> dict:
        return {"domain_weights": dict(zip(self.names, self.weights))}

    def after_training(self) -> None:
        if self.history is not None:
            self.history.close()
