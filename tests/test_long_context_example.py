"""examples/config_tiny_long.yaml, the long-context example README points to, trains as written: a Qwen2 model at
sequence 8192 split over 2 context-parallel ranks with document masking, only its data, tokenizer and checkpoint
paths swapped for the test corpus's (same sequence, same model, the file's own parallelism)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from nanotron.config import load_config
from support.runs import train_on_ranks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "config_tiny_long.yaml"
STEPS = 2


def _with_test_paths(raw: dict, tiny_data: dict[str, Path], run: Path) -> dict:
    """The example with the quickstart's paths replaced by the test corpus's, and 2 steps instead of its 20."""
    raw["checkpoints"]["checkpoints_path"] = str(run)
    raw["tokenizer"]["tokenizer_name_or_path"] = str(tiny_data["tokenizer"])
    for stage in raw["data_stages"]:
        stage["data"]["dataset"]["dataset_folder"] = str(tiny_data["tokenized"])
    raw["tokens"]["train_steps"] = STEPS
    return raw


def test_the_long_context_example_is_what_the_readme_says():
    config = load_config(EXAMPLE)  # the strict file loader: unknown or duplicate keys would fail here
    model = config.model.model_config
    assert config.parallelism.context_parallel_size == 2 and config.tokens.sequence_length == 8192
    assert model.is_qwen2_config and model._use_doc_masking and model.z_loss_enabled
    assert model.max_position_embeddings >= config.tokens.sequence_length


@pytest.mark.full_tier
@pytest.mark.slow  # context parallelism with document masking trains in the quick tier in test_context_parallel.py
def test_the_long_context_example_trains_on_two_context_parallel_ranks(tiny_data, tmp_path):
    run = tmp_path / "run"
    raw = _with_test_paths(yaml.safe_load(EXAMPLE.read_text()), tiny_data, run)
    ranks = raw["parallelism"]["context_parallel_size"]
    records = train_on_ranks(raw, ranks)
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    for record in records:
        assert math.isfinite(record["lm_loss"]) and math.isfinite(record["grad_norm"]), record
        assert math.isfinite(record["z_loss"]) and record["z_loss"] > 0, record
        assert record["consumed_tokens"] == 8192 * record["step"]  # whole sequences of 8192, shared by the 2 ranks
    assert (run / str(STEPS)).is_dir()  # the final checkpoint of the cp=2 run
