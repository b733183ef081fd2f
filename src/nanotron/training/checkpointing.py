"""A training run's folder and checkpoints, from the lock taken before anything is built to the last save.

Before the model exists: the folder is locked and checked (a run is never started over another one), the checkpoint
to resume from or to take the initial weights from is verified (checksums, architecture, tokenizer, steps left, and
what each feature needs of it), and the metrics file is checked to belong to this run. Once the model and optimizer
exist: the initial state is loaded (weights, optimizer, schedule, data position, random states). While training:
saves, in the foreground or in the background (``checkpoints.async_save``), each with the features' state in its
checkpoint.json; and the newest checkpoint from before a bad step is kept out of pruning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from nanotron.checkpoint.async_saving import AsyncCheckpointer
from nanotron.checkpoint.integrity import read_metadata
from nanotron.checkpoint.manager import (
    TrainingProgress,
    check_same_model,
    first_problem,
    load_optimizer,
    load_rng,
    load_weights,
    verify_on_all_ranks,
)
from nanotron.checkpoint.node_folders import FolderRanks
from nanotron.checkpoint.run_folder import (
    check_metrics_file,
    describe_existing_run,
    remove_partial_saves,
    resolve_checkpoint,
)
from nanotron.checkpoint.run_lock import RunLock
from nanotron.checkpoint.saving import take_snapshot, write_snapshot
from nanotron.config import Config, ConfigError, ExistingCheckpointInit
from nanotron.data.dataset import DataError, SampleSource
from nanotron.errors import CheckpointError
from nanotron.layout import Layout
from nanotron.models.spec import CausalLM
from nanotron.optim.optimizer import MixedPrecisionAdamW
from nanotron.parallel.context import ParallelContext
from nanotron.training.data_record import DATA_STAGES, data_stages_record, resumed_data_position
from nanotron.training.hooks import Feature

logger = logging.getLogger("nanotron.trainer")


class RunCheckpoints:
    """The checkpoints of the run that ``config`` describes; creating it locks the run folder (rank 0) and decides
    what to resume from (``resume_from``)."""

    def __init__(self, config: Config, pc: ParallelContext):
        self.config, self.pc = config, pc
        self.run_lock: RunLock | None = None  # the folder's main rank's, released by ``close``
        self.protected: set[str] = set()  # the newest checkpoint from before a bad step
        self.data_stages: dict[str, dict] = {}  # what defines each data stage's order, for every save (``data_record``)
        # Its process group is created here, at the same point on every rank.
        self.async_saver = AsyncCheckpointer(pc) if config.checkpoints.async_save else None
        try:
            self.resume_from = self._prepare_run_folder()
        except BaseException:
            self.close()  # a refused folder stays unlocked
            raise

    def _prepare_run_folder(self) -> Path | None:
        """Lock and check the run folder before anything is built; the checkpoint to resume from, if any.

        Rank 0 (each node's lowest rank where nodes have folders of their own: ``node_folders.py``) first takes the
        folder's lock (``run_lock.py``), before the folder is read: a second run on it is refused. Starting from
        scratch over an earlier run would overwrite its checkpoints and metrics, so it is refused unless the config
        resumes (``resume_checkpoint_path``, or ``auto``: resume if there is a checkpoint). Rank 0 also removes
        what interrupted saves left; every rank gets its verdict, and only then looks at the folder itself.
        """
        root = Path(self.config.checkpoints.checkpoints_path)
        self.folder = FolderRanks.find(root, self.config.checkpoints.checkpoints_path_is_shared_file_system, self.pc)
        problem = None
        if self.folder.is_main:
            try:
                self.run_lock = RunLock.take(root)
                existing = describe_existing_run(root)
                if self._resume_choice(root) is None and existing is not None:
                    raise ConfigError(
                        f"checkpoints.checkpoints_path {root} already holds a run ({existing}); continue it with "
                        "checkpoints.resume_checkpoint_path: auto (or its path), or start over in another "
                        "checkpoints_path")
                remove_partial_saves(root)
            except (ConfigError, CheckpointError) as error:
                problem = str(error)
        problem = first_problem(problem, self.pc.world_size)
        if problem is not None:
            raise ConfigError(problem)
        return self.folder.same_checkpoint(self._resume_choice(root))

    def _resume_choice(self, root: Path) -> Path | None:
        checkpoints = self.config.checkpoints
        if checkpoints.resumes_if_present:
            return root if describe_existing_run(root) is not None else None
        return checkpoints.resume_checkpoint_path

    # --- before the model exists -----------------------------------------------------------------------------

    def initial_checkpoint(self, datasets: dict[str, SampleSource],
                           features: Sequence[Feature]) -> tuple[Path, dict] | None:
        """The checkpoint to resume from or to take the initial weights from, checked before the model exists:
        complete and uncorrupted (checksums, the reading shared by all ranks), the same architecture, trained on
        data from the same tokenizer, and loadable by every feature, which takes its state from it on a resume. On a
        resume its data position is held against the data stages (``data_record``: renamed stages, changed sample
        orders): the metadata returned has the consumed samples keyed by this config's stage names."""
        self.data_stages = data_stages_record(self.config, datasets)
        init = self.config.model.init_method
        if self.resume_from is not None:
            path = self.resume_from
        elif isinstance(init, ExistingCheckpointInit):
            path = init.path
        else:
            return None
        checkpoint = resolve_checkpoint(path)
        metadata = read_metadata(checkpoint)
        verify_on_all_ranks(checkpoint, metadata, self.pc)
        check_same_model(checkpoint, metadata, self.config.model.model_config)
        if self.resume_from is not None and metadata["step"] >= self.config.tokens.train_steps:
            raise ConfigError(
                f"the checkpoint {checkpoint} is at step {metadata['step']} and tokens.train_steps is "
                f"{self.config.tokens.train_steps}: nothing left to train; raise tokens.train_steps"
            )
        self._check_same_tokenizer(checkpoint, metadata.get("tokenizer_fingerprint"), datasets)
        if self.resume_from is not None:
            self._check_same_optimizer(checkpoint, metadata)
            position = resumed_data_position(checkpoint, metadata, self.config, self.data_stages)
            for note in position.notes if self.pc.rank == 0 else ():
                logger.warning(note)
            metadata = metadata | {"consumed_samples": position.consumed_samples}
        for feature in features:
            feature.check_checkpoint(checkpoint, metadata)
            if self.resume_from is not None:
                feature.load_state_dict(checkpoint, metadata)
        return checkpoint, metadata

    def _check_same_optimizer(self, checkpoint: Path, metadata: dict) -> None:
        """The optimizer state of a checkpoint is that of its optimizer: resuming it with another is refused, unless
        the state starts fresh (``checkpoints.load_optimizer: false``). Checkpoints that name none are AdamW's."""
        saved, now = metadata.get("optimizer", "adamw"), self.config.optimizer.name
        if saved != now and metadata["optimizer_step"] > 0 and self.config.checkpoints.load_optimizer:
            raise ConfigError(
                f"optimizer.optimizer_factory.name is {now} but {checkpoint} holds the state of {saved}; resume with "
                f"optimizer.optimizer_factory.name: {saved}, or set checkpoints.load_optimizer: false to switch to "
                f"{now} with fresh optimizer state (the weights, schedule and data position are kept)")

    def _check_same_tokenizer(self, checkpoint: Path, trained_with: str | None,
                              datasets: dict[str, SampleSource]) -> None:
        """Token ids only mean something with their tokenizer: training weights further (resumed, or taken by
        ``model.init_method.path``) on data from another one is refused, whatever its vocabulary size."""
        if trained_with is None or self.config.checkpoints.allow_tokenizer_change:
            return
        for stage in self.config.data_stages:
            dataset = datasets[stage.name]
            for domain, fingerprint in zip(dataset.domain_sources, dataset.tokenizer_fingerprints):
                if fingerprint is not None and fingerprint != trained_with:  # None: the source records none
                    raise DataError(
                        f"{domain} was tokenized with another tokenizer than the one {checkpoint} was trained on "
                        "(tokenizer fingerprints differ); use data tokenized with the checkpoint's tokenizer (its "
                        "tokenizer/ folder), or set checkpoints.allow_tokenizer_change: true to train on it on purpose")

    def check_metrics_file(self, initial: tuple[Path, dict] | None) -> None:
        """Refuse, on every rank, a ``logging.metrics_path`` that holds another run's metrics (rank 0 writes it)."""
        problem = None
        if self.pc.rank == 0:
            resumed = initial[0] if self.resume_from is not None else None
            try:
                check_metrics_file(self.config.resolved_metrics_path(), Path(self.config.checkpoints.checkpoints_path),
                                   resumed)
            except ConfigError as error:
                problem = str(error)
        problem = first_problem(problem, self.pc.world_size)
        if problem is not None:
            raise ConfigError(problem)

    # --- once the model and optimizer exist ------------------------------------------------------------------

    def load_initial_state(self, initial: tuple[Path, dict] | None, model: CausalLM,
                           optimizer: MixedPrecisionAdamW) -> TrainingProgress:
        """Load the weights of ``initial`` and, on a resume, the rest of the training state; where training
        stands."""
        checkpoints = self.config.checkpoints
        if initial is None:
            return TrainingProgress()
        checkpoint, metadata = initial
        load_weights(checkpoint, model, self.pc, metadata, optimizer.buckets.whole_parameters(write_back=True))
        if self.resume_from is None:
            optimizer.sync_masters_from_model()
            logger.info(f"initial weights loaded from {checkpoint} (optimizer, schedule and data start fresh)")
            return TrainingProgress()
        if metadata["optimizer_step"] > 0 and checkpoints.load_optimizer:
            load_optimizer(checkpoint, optimizer, model, self.pc, metadata)
        else:
            optimizer.sync_masters_from_model()
        schedule_start = metadata["lr_schedule_start_step"] if checkpoints.load_lr_scheduler else metadata["step"]
        progress = TrainingProgress(metadata["step"], dict(metadata["consumed_samples"]), schedule_start,
                                    metadata["consumed_tokens"])
        if not load_rng(checkpoint, self.pc):
            logger.warning("random states re-derived from the seed: the checkpoint has no rank at this position")
        saved, now = Layout.recorded(metadata["layout"]), self.pc.layout.to_dict()
        if saved != now:
            logger.info(f"checkpoint layout {saved} resharded to {now}")
        fresh = [what for what, kept in (("optimizer state", checkpoints.load_optimizer),
                                         ("LR schedule", checkpoints.load_lr_scheduler)) if not kept]
        logger.info(f"resumed from {checkpoint} at step {progress.step}"
                    + (f" (fresh {' and '.join(fresh)})" if fresh else ""))
        return progress

    # --- while training --------------------------------------------------------------------------------------

    def save(self, model: CausalLM, optimizer: MixedPrecisionAdamW, progress: TrainingProgress,
             tokenizer_fingerprint: str | None, features: Sequence[Feature]) -> None:
        """Checkpoint the current step, in the foreground or (``checkpoints.async_save``) in the background."""
        entries = {DATA_STAGES: self.data_stages}
        entries |= {key: value for feature in features for key, value in feature.state_dict().items()}
        if self.async_saver is None:
            snapshot = take_snapshot(self.config, model, optimizer, progress, self.pc, tokenizer_fingerprint,
                                     extra_entries=entries, folder=self.folder)
            write_snapshot(snapshot, self.pc, protected=self.protected)
        else:
            self.async_saver.save(lambda: take_snapshot(self.config, model, optimizer, progress, self.pc,
                                                        tokenizer_fingerprint, self.async_saver.buffers,
                                                        entries, self.folder),
                                  self.protected)

    def protect_latest(self) -> None:
        """Keep the newest checkpoint (from before a bad step) out of pruning."""
        root = Path(self.config.checkpoints.checkpoints_path)
        if describe_existing_run(root) is not None:
            self.protected.add(resolve_checkpoint(root).name)

    def wait(self) -> None:
        """Until the save in flight, if any, is written; its failure is raised here."""
        if self.async_saver is not None:
            self.async_saver.wait()

    def close(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
