"""Where checkpoints go and what a resume loads back: the ``checkpoints`` section."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanotron.config.rules import at_least

RESUME_IF_PRESENT = "auto"


@dataclass
class CheckpointsArgs:
    checkpoints_path: Path
    checkpoint_interval: int
    save_initial_state: bool = False
    save_final_state: bool = True
    resume_checkpoint_path: Path | None = None
    # False: each node may see its own checkpoints_path folder, which then holds its own ranks' files.
    checkpoints_path_is_shared_file_system: bool = True
    keep_last_n: int | None = None  # None keeps every checkpoint
    load_optimizer: bool = True  # on resume; False: fresh Adam moments, masters taken from the loaded weights
    # On resume; False: the LR schedule starts again (warmup included) at the resume step.
    load_lr_scheduler: bool = True
    allow_tokenizer_change: bool = False  # resume or init_method.path on data of another tokenizer than its own
    async_save: bool = False  # write checkpoints in the background; training waits only for a snapshot in host memory

    @property
    def resumes_if_present(self) -> bool:
        """``resume_checkpoint_path: auto``: resume from ``checkpoints_path`` when it holds a checkpoint."""
        return self.resume_checkpoint_path is not None and str(self.resume_checkpoint_path) == RESUME_IF_PRESENT

    def problems(self) -> Iterator[str]:
        yield from at_least("checkpoints.checkpoint_interval", self.checkpoint_interval, 1)
        if self.keep_last_n is not None:
            yield from at_least("checkpoints.keep_last_n", self.keep_last_n, 1)
