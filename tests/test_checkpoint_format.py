"""The checkpoint format: logical tensors read back in any slicing, missing and corrupt pieces named, the model
family recorded, and a checkpoint written by a newer nanotron refused by every command that reads one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanotron.checkpoint.logical_tensors import FORMAT_VERSION, LogicalTensorReader, write_boxes
from nanotron.checkpoint.run_folder import resolve_checkpoint
from nanotron.errors import CheckpointError
from nanotron.parallel.placement import Placement, Shard
from support import ROOT
from support.configs import resume_config, write_config
from support.runs import Outcome, assert_user_error, cli, fresh_environment


def test_fused_tensor_written_by_two_ranks_reads_back_in_any_slicing(tmp_path):
    """Two 'TP ranks' write chunk-sharded q|k|v rows; a reader with another sharding gets the right values."""
    logical = torch.arange(24 * 3, dtype=torch.float32).view(24, 3)
    placement = Placement("qkv.weight", (24, 3), shards=(Shard("tp", 0, chunks=(16, 4, 4)),))
    for rank in range(2):
        boxes = []
        local = torch.empty(placement.local_shape({"tp": 2}))
        for local_slices, logical_slices in placement.boxes({"tp": rank}, {"tp": 2}):
            local[local_slices] = logical[logical_slices]
        for local_slices, logical_slices in placement.boxes({"tp": rank}, {"tp": 2}):
            boxes.append(("qkv.weight", (24, 3), logical_slices, local[local_slices]))
        write_boxes(tmp_path / f"rank{rank}.safetensors", boxes)

    reader = LogicalTensorReader(tmp_path)
    full = torch.empty(24, 3)
    reader.read_into("qkv.weight", (slice(0, 24), slice(0, 3)), full)
    assert torch.equal(full, logical)
    # A 4-way reader's rank 3 needs the last quarter of each chunk.
    other = Placement("qkv.weight", (24, 3), shards=(Shard("tp", 0, chunks=(16, 4, 4)),))
    piece = torch.empty(other.local_shape({"tp": 4}))
    for local_slices, logical_slices in other.boxes({"tp": 3}, {"tp": 4}):
        reader.read_into("qkv.weight", logical_slices, piece[local_slices])
    assert torch.equal(piece, torch.cat([logical[12:16], logical[19:20], logical[23:24]]))


def test_missing_piece_and_corrupt_file_are_named(tmp_path):
    write_boxes(tmp_path / "a.safetensors", [("w", (4, 2), (slice(0, 2), slice(0, 2)), torch.ones(2, 2))])
    reader = LogicalTensorReader(tmp_path)
    with pytest.raises(CheckpointError, match="shard file is missing"):
        reader.read_into("w", (slice(0, 4), slice(0, 2)), torch.empty(4, 2))
    (tmp_path / "b.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(CheckpointError, match="b.safetensors"):
        LogicalTensorReader(tmp_path)


def test_resume_path_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "latest.txt").write_text("5\n")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_checkpoint(tmp_path)


# --- a checkpoint written by a newer nanotron -----------------------------------------------------------------------

@pytest.fixture
def newer(base, tmp_path) -> Path:
    """A copy of the base run whose checkpoint.json claims the next format version."""
    run = tmp_path / "newer"
    shutil.copytree(base["run"], run)
    metadata_file = run / "2" / "checkpoint.json"
    metadata = json.loads(metadata_file.read_text())
    metadata["format_version"] = FORMAT_VERSION + 1
    metadata_file.write_text(json.dumps(metadata, indent=2, sort_keys=True))
    return run


def _newer_fragments(newer: Path) -> tuple[str, ...]:
    return str(newer / "2"), "newer nanotron", f"format {FORMAT_VERSION + 1}"


def test_resume_from_a_newer_checkpoint_format_is_refused(base, newer, tmp_path):
    config = resume_config(base, tmp_path / "run")
    config["checkpoints"]["resume_checkpoint_path"] = str(newer)
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, *_newer_fragments(newer))
    assert not (tmp_path / "run" / "latest.txt").exists()


def test_eval_of_a_newer_checkpoint_format_is_refused(tiny_data, newer, tmp_path):
    outcome = cli("eval", "--ckpt-path", newer, "--data", tiny_data["tokenized"], "--sequence-length", 16,
                  "--max-windows", 2, "--output", tmp_path / "eval.json")
    assert_user_error(outcome, *_newer_fragments(newer))
    assert not (tmp_path / "eval.json").exists()


@pytest.mark.slow
def test_run_generate_of_a_newer_checkpoint_format_is_refused(newer):
    result = subprocess.run(
        [sys.executable, str(ROOT / "run_generate.py"), "--ckpt-path", str(newer), "--prompt", "the cat",
         "--max-new-tokens", "2"],
        capture_output=True, text=True, timeout=120, env=fresh_environment())
    assert_user_error(Outcome(result.returncode, result.stdout, result.stderr), *_newer_fragments(newer))
    assert "===" not in result.stdout  # nothing was generated


def test_convert_of_a_newer_checkpoint_format_is_refused(newer, tmp_path):
    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", newer, "--save-path", tmp_path / "hf")
    assert_user_error(outcome, *_newer_fragments(newer))
    assert not (tmp_path / "hf").exists()


def test_checkpoint_records_the_model_type_and_one_without_it_is_refused(tmp_path):
    from nanotron.checkpoint.manager import checkpoint_model, model_metadata
    from nanotron.config import LlamaConfig
    from nanotron.errors import CheckpointError

    config = LlamaConfig(num_hidden_layers=3)
    metadata = {"model": model_metadata(config, 32000, "bfloat16")}
    assert metadata["model"]["type"] == "llama" and metadata["model"]["padded_vocab_size"] == 32000
    assert checkpoint_model(tmp_path, metadata) == (checkpoint_model(tmp_path, metadata)[0], config)
    del metadata["model"]["type"]
    for version in (1, 3):  # format 1, which named none, is refused before (tests/test_checkpoint_integrity.py)
        with pytest.raises(CheckpointError, match="names no model family"):
            checkpoint_model(tmp_path, metadata | {"format_version": version})
