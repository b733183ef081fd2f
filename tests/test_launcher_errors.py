"""A user error under torchrun reaches the user once, whichever rank the launcher sees fail first."""

import subprocess
import sys

import pytest

from support import ROOT
from support.configs import short_config, write_config
from support.runs import fresh_environment


@pytest.mark.full_tier
def test_a_config_error_is_printed_once_even_when_another_rank_exits_first(tiny_data, tmp_path):
    """Rank 0 is held back 3 s before it starts, so rank 1 meets the (same) config error first. Had rank 1 exited
    at once, the launcher would have stopped rank 0 before it printed: a failed job without an error line."""
    config = short_config(tiny_data, tmp_path / "run", 2)
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = -1
    path = write_config(tmp_path / "config.yaml", config)
    train = f"{sys.executable} {ROOT / 'run_train.py'} --config-file {path}"
    rank0_starts_late = f'[ "$RANK" = 0 ] && sleep 3; exec {train}'
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python", "sh", "-c",
         rank0_starts_late],
        capture_output=True, text=True, timeout=120,
        env=fresh_environment(OMP_NUM_THREADS="1"))
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, output[-3000:]
    assert "lr_warmup_steps" in errors[0], errors[0]
