import pytest
import torch

from nanotron.checkpoint.logical_tensors import LogicalTensorReader, write_boxes
from nanotron.checkpoint.run_folder import resolve_checkpoint
from nanotron.errors import CheckpointError
from nanotron.parallel.placement import Placement, Shard


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
