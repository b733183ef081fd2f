"""The ids of a preprocessed folder are checked against its vocabulary from the id range that ``nanotron preprocess``
records for each shard, without reading the shards (which would cost every rank of every run a pass over the
dataset); a folder without recorded ranges is still checked by reading it, once. Every window read is checked against
the range of its shard, so a shard changed since it was recorded stops the run with one line naming it, as do ids
outside the vocabulary in a folder that records no range.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from nanotron.data.dataset import DataError, TokenShards
from nanotron.data.preprocess import preprocess
from support.configs import folder_stage, short_config, write_config
from support.corpus import without_id_ranges
from support.processes import training_outcome
from support.runs import (
    assert_user_error,
    cli,
    python_process,
)

_TOKENS_PER_SHARD = 4096


@pytest.fixture(scope="module")
def sharded(tiny_data, tmp_path_factory) -> Path:
    """The tiny corpus preprocessed into several shards."""
    folder = tmp_path_factory.mktemp("sharded") / "data"
    preprocess([tiny_data["corpus"]], tiny_data["tokenizer"], folder, num_workers=1,
               tokens_per_shard=_TOKENS_PER_SHARD)
    return folder


@pytest.fixture
def reads(monkeypatch) -> list[Path]:
    """The shards whose ids TokenShards checks by reading them, in order."""
    read = TokenShards._check_ids_by_reading
    paths = []

    def recorded(self, path, tokens):
        paths.append(path)
        return read(self, path, tokens)

    monkeypatch.setattr(TokenShards, "_check_ids_by_reading", recorded)
    return paths


def _edited_copy(source: Path, folder: Path, edit) -> tuple[Path, dict]:
    """A copy of ``source`` whose metadata is ``edit(folder, metadata)``; returns the folder and its new metadata."""
    shutil.copytree(source, folder)
    metadata = edit(folder, json.loads((folder / "metadata.json").read_text()))
    (folder / "metadata.json").write_text(json.dumps(metadata))
    return folder, metadata


def _as_int32(folder: Path, metadata: dict) -> dict:
    """The shards rewritten as int32, whose ids could be negative as far as the dtype says."""
    for shard in metadata["shards"]:
        np.save(folder / shard["tokens"], np.load(folder / shard["tokens"]).astype(np.int32))
    return metadata | {"dtype": "int32"}


def test_preprocess_records_the_smallest_and_largest_id_of_each_shard(sharded):
    shards = json.loads((sharded / "metadata.json").read_text())["shards"]
    assert len(shards) >= 3
    for shard in shards:
        tokens = np.load(sharded / shard["tokens"])
        assert (shard["min_token_id"], shard["max_token_id"]) == (int(tokens.min()), int(tokens.max()))


def test_a_folder_from_preprocess_is_checked_without_reading_its_shards(sharded, reads):
    shards = TokenShards(sharded)
    assert reads == []
    assert shards.read(0, 8).tolist() == np.load(sharded / "tokens-00000.npy")[:8].tolist()


def test_a_shard_altered_after_preprocessing_opens_unread_and_its_window_is_refused_when_read(sharded, tmp_path):
    """The proof, without instrumenting the code, that opening does not read the shard: an id written past the
    vocabulary after ``nanotron preprocess`` goes unseen while the metadata keeps its range. The window that holds it
    is refused when read, naming the shard and the offset in it."""
    folder, metadata = _edited_copy(sharded, tmp_path / "data", lambda _, metadata: metadata)
    shard, vocab = metadata["shards"][1], metadata["tokenizer"]["vocab_size"]
    tokens = np.load(folder / shard["tokens"], mmap_mode="r+")
    tokens[3] = vocab
    tokens.flush()
    opened = TokenShards(folder)
    assert opened.read(_TOKENS_PER_SHARD, 3).tolist() == np.load(sharded / shard["tokens"])[:3].tolist()
    with pytest.raises(DataError) as error:
        opened.read(_TOKENS_PER_SHARD - 8, 12)  # from the first shard into the id
    assert str(error.value) == (
        f"shard {folder / shard['tokens']} holds token id {vocab} at token 3, outside the range "
        f"{shard['min_token_id']} to {shard['max_token_id']} that metadata.json records for it: the folder is "
        "corrupt; re-run `nanotron preprocess` to rebuild the folder")


def test_a_signed_shard_with_a_recorded_range_inside_the_vocabulary_is_not_read(sharded, tmp_path, reads):
    TokenShards(_edited_copy(sharded, tmp_path / "data", _as_int32)[0])
    assert reads == []


def test_a_folder_without_recorded_ranges_is_checked_by_reading_each_shard_once(sharded, tmp_path, reads):
    folder, metadata = _edited_copy(sharded, tmp_path / "data", lambda _, metadata: without_id_ranges(metadata))
    opened = TokenShards(folder)
    assert reads == [folder / shard["tokens"] for shard in metadata["shards"]]
    pickle.loads(pickle.dumps(opened))  # the copy a data-loading worker opens
    assert len(reads) == len(metadata["shards"])


def test_a_uint16_shard_is_not_read_when_the_vocabulary_holds_every_uint16_id(sharded, tmp_path, reads):
    def without_ranges_of_a_larger_vocabulary(_, metadata: dict) -> dict:
        return without_id_ranges(metadata) | {"tokenizer": metadata["tokenizer"] | {"vocab_size": 1 << 16}}

    folder, metadata = _edited_copy(sharded, tmp_path / "data", without_ranges_of_a_larger_vocabulary)
    assert metadata["dtype"] == "uint16"
    TokenShards(folder)
    assert reads == []


@pytest.mark.parametrize("bound", ["max_token_id", "min_token_id"])
def test_a_recorded_range_outside_the_vocabulary_is_refused_naming_the_shard(tiny_data, sharded, tmp_path, reads,
                                                                           bound):
    def past_the_vocabulary(folder: Path, metadata: dict) -> dict:
        if bound == "min_token_id":
            metadata = _as_int32(folder, metadata)  # a uint16 shard holds no negative id, whatever it records
        metadata["shards"][1][bound] = metadata["tokenizer"]["vocab_size"] if bound == "max_token_id" else -1
        return metadata

    folder, metadata = _edited_copy(sharded, tmp_path / "data", past_the_vocabulary)
    shard, vocab = metadata["shards"][1], metadata["tokenizer"]["vocab_size"]
    stage = {"name": "main", "start_training_step": 1,
             "data": {"seed": 3, "num_loading_workers": 0, "dataset": {"dataset_folder": [str(folder)]}}}
    config = short_config(tiny_data, tmp_path / "run", 2, data_stages=[stage])
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      f"shard {folder / shard['tokens']} holds token ids {shard['min_token_id']} to "
                      f"{shard['max_token_id']} as recorded in metadata.json",
                      f"outside the vocabulary of its tokenizer ({vocab} ids)", "re-run `nanotron preprocess`")
    assert reads == []


def test_half_a_recorded_range_is_malformed_metadata(sharded, tmp_path):
    def without_a_largest_id(_, metadata: dict) -> dict:
        del metadata["shards"][0]["max_token_id"]
        return metadata

    folder, _ = _edited_copy(sharded, tmp_path / "data", without_a_largest_id)
    with pytest.raises(DataError, match=r"metadata.json is malformed \(KeyError: 'max_token_id'\)"):
        TokenShards(folder)


def _negative_ids(folder: Path, metadata: dict) -> dict:
    """Every 50th token of every shard rewritten as -3, the shards as int32, their recorded ranges kept: a folder
    edited after ``nanotron preprocess``, whose ranges still fit the vocabulary."""
    metadata = _as_int32(folder, metadata)
    for shard in metadata["shards"]:
        tokens = np.load(folder / shard["tokens"])
        tokens[::50] = -3
        np.save(folder / shard["tokens"], tokens)
    return metadata


@pytest.mark.slow
def test_a_shard_disagreeing_with_its_recorded_range_ends_a_run_with_loader_workers_in_one_line(tiny_data, sharded,
                                                                                              tmp_path):
    """It used to stop in the embedding (IndexError) and then hang on the loader worker, for an hour and more."""
    folder, metadata = _edited_copy(sharded, tmp_path / "data", _negative_ids)
    stage = {"name": "main", "start_training_step": 1,
             "data": {"seed": 3, "num_loading_workers": 1, "dataset": {"dataset_folder": [str(folder)]}}}
    config = write_config(tmp_path / "config.yaml", short_config(tiny_data, tmp_path / "run", 4, data_stages=[stage]))
    line = assert_user_error(training_outcome(config, [sys.executable], tmp_path / "train.log", timeout_s=120),
                             "holds token id -3 at token", "that metadata.json records for it: the folder is corrupt")
    ranges = {str(folder / shard["tokens"]): (shard["min_token_id"], shard["max_token_id"])
              for shard in metadata["shards"]}
    found = re.search(r"shard (\S+) holds token id -3 at token (\d+), outside the range (\d+) to (\d+) ", line)
    assert found and ranges[found[1]] == (int(found[3]), int(found[4])) and int(found[2]) % 50 == 0, line


def _damaged_copy(tiny_data, folder: Path, bad_id: str) -> tuple[Path, int, int]:
    """A copy of the tiny folder whose first shard, rewritten as int32, holds an id outside the vocabulary in every
    training window: the vocabulary size (``bad_id="past"``) or -1 (``"negative"``). Its metadata records no id
    range, as a folder edited by hand or written by an earlier version, so the shard is read. Returns the shard, the
    id and its first position."""
    shutil.copytree(tiny_data["tokenized"], folder)
    metadata = json.loads((folder / "metadata.json").read_text())
    shard = folder / metadata["shards"][0]["tokens"]
    tokens = np.load(shard).astype(np.int32)
    value, position = metadata["tokenizer"]["vocab_size"] if bad_id == "past" else -1, 7
    tokens[position::16] = value
    np.save(shard, tokens)
    (folder / "metadata.json").write_text(json.dumps(without_id_ranges(metadata) | {"dtype": "int32"}))
    return shard, value, position


@pytest.mark.parametrize("bad_id", ["past", pytest.param("negative", marks=pytest.mark.slow)])
def test_a_shard_with_ids_outside_the_vocabulary_is_one_error_naming_it(tiny_data, tmp_path, bad_id):
    shard, value, position = _damaged_copy(tiny_data, tmp_path / "data", bad_id)
    config = short_config(tiny_data, tmp_path / "run", 2, data_stages=[folder_stage(tmp_path / "data", workers=1)])
    outcome = python_process("run_train.py", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, f"shard {shard} holds token id {value} at token {position}", "outside the vocabulary")


def test_a_shard_is_read_whole_once_when_opened_then_window_by_window(tiny_data, tmp_path):
    from nanotron.data.dataset import DataError, TokenShards

    shard, value, position = _damaged_copy(tiny_data, tmp_path / "data", "past")
    with pytest.raises(DataError, match="outside the vocabulary"):
        TokenShards(tmp_path / "data")
    # The copy a data-loading worker opens (ids already checked) does not scan the tokens again; it checks the
    # windows it reads.
    worker_copy = TokenShards(tmp_path / "data", ids_checked=True)
    assert len(worker_copy.read(0, position)) == position
    with pytest.raises(DataError, match=f"shard {shard} holds token id {value} at token {position}, outside the "
                                        f"vocabulary of its tokenizer \\({value} ids\\)"):
        worker_copy.read(0, position + 1)


def test_out_of_vocabulary_ids_in_a_shard_are_one_error(tiny_data, tmp_path):
    import numpy as np

    data = tmp_path / "data"
    shutil.copytree(tiny_data["tokenized"], data)
    metadata = json.loads((data / "metadata.json").read_text())
    shard = data / metadata["shards"][0]["tokens"]
    vocab = metadata["tokenizer"]["vocab_size"]
    tokens = np.load(shard, mmap_mode="r+")
    tokens[::16] = vocab  # one id past the vocabulary in every training window
    tokens.flush()
    (data / "metadata.json").write_text(json.dumps(without_id_ranges(metadata)))  # edited: the shard is read
    stage = {"name": "main", "start_training_step": 1,
             "data": {"seed": 3, "num_loading_workers": 0, "dataset": {"dataset_folder": [str(data)]}}}
    config = short_config(tiny_data, tmp_path / "run", 4, data_stages=[stage])
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      str(data), f"token id {vocab} at token", f"outside the vocabulary of its tokenizer ({vocab} ids)")
