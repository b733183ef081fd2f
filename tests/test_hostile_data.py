"""Hostile inputs that used to pass or to hang: YAML alias bombs, DoReMi weights resumed onto renamed or reordered
domains, initial weights trained with another tokenizer, and token ids outside the vocabulary in a shard.

Each is refused by the real entry point (``run_train.py`` or ``nanotron`` in a subprocess) with exit status 2 and
one ``error:`` line naming the key or file, and no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_config, write_corpus
from test_bad_inputs import ROOT, Outcome, _config, assert_user_error, cli


def run_process(*args) -> Outcome:
    """``python ARGS`` in a fresh process from the repository root, on the CPU."""
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "NANOTRON_DEVICE": "cpu"})
    return Outcome(result.returncode, result.stdout, result.stderr)


# --- YAML alias bombs ----------------------------------------------------------------------------------------------

def _nested_aliases(levels: int) -> str:
    """A flow list of ``levels`` anchored lists, each holding the previous one 9 times: 9**levels values."""
    lists = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    lists += [f"&l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]" for level in range(1, levels)]
    return "[" + ", ".join(lists) + "]"


@pytest.mark.parametrize("document, key", [
    ("general:\n  project: {laughs}\n", "general.project[5]"),
    ("data_stages: {laughs}\n", "data_stages[5]"),
], ids=["general.project", "data_stages"])
def test_nested_yaml_aliases_are_refused_at_once(tmp_path, document, key):
    config = tmp_path / "laughs.yaml"
    config.write_text(document.format(laughs=_nested_aliases(7)))  # 9**7 = 4.8M values from 300 bytes
    fragments = (str(config), f"'{key}' holds more than 100,000 values once its YAML aliases", "write the values out")
    import nanotron.trainer  # noqa: F401  (imported by the command before it reads the config: not timed)

    start = time.perf_counter()
    outcome = cli("train", "--config-file", config)
    assert time.perf_counter() - start < 0.5
    assert_user_error(outcome, *fragments)
    assert_user_error(run_process("run_train.py", "--config-file", config), *fragments)


def test_an_alias_of_its_own_container_is_refused(tmp_path):
    config = tmp_path / "loop.yaml"
    config.write_text("general: &g\n  project: *g\n")
    assert_user_error(cli("train", "--config-file", config), str(config), "'general.project' is an alias of a value "
                                                                          "that contains it")


# --- data of another tokenizer, ids outside the vocabulary ---------------------------------------------------------

def _stage(folder: Path, workers: int = 0) -> dict:
    return {"name": "main", "start_training_step": 1,
            "data": {"seed": 3, "num_loading_workers": workers, "dataset": {"dataset_folder": [str(folder)]}}}


def test_initial_weights_trained_with_another_tokenizer_of_the_same_size_are_refused(tiny_data, tmp_path):
    from nanotron.data.preprocess import preprocess
    from nanotron.data.tokenizer import load_tokenizer, train_tokenizer

    trained = tmp_path / "trained"
    assert cli("train", "--config-file", write_config(tmp_path / "a.yaml", _config(tiny_data, trained, 1))).code == 0
    corpus = write_corpus(tmp_path / "raw", documents=200, seed=5)
    other = train_tokenizer([corpus], 384, tmp_path / "other.json")
    assert load_tokenizer(other).get_vocab_size() == load_tokenizer(tiny_data["tokenizer"]).get_vocab_size()
    preprocess([corpus], other, tmp_path / "other_data", num_workers=1)
    config = _config(tiny_data, tmp_path / "run", 2, tokenizer={"tokenizer_name_or_path": str(other)},
                     data_stages=[_stage(tmp_path / "other_data")])
    config["model"]["init_method"] = {"path": str(trained)}
    outcome = run_process("run_train.py", "--config-file", write_config(tmp_path / "init.yaml", config))
    assert_user_error(outcome, str(tmp_path / "other_data"), "another tokenizer", "checkpoints.allow_tokenizer_change")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    config["checkpoints"]["allow_tokenizer_change"] = True
    assert cli("train", "--config-file", write_config(tmp_path / "allowed.yaml", config)).code == 0


def _damaged_copy(tiny_data, folder: Path, bad_id: str) -> tuple[Path, int, int]:
    """A copy of the tiny folder whose first shard, rewritten as int32, holds an id outside the vocabulary in every
    training window: the vocabulary size (``bad_id="past"``) or -1 (``"negative"``). Returns the shard, the id and
    its first position."""
    shutil.copytree(tiny_data["tokenized"], folder)
    metadata = json.loads((folder / "metadata.json").read_text())
    shard = folder / metadata["shards"][0]["tokens"]
    tokens = np.load(shard).astype(np.int32)
    value, position = metadata["tokenizer"]["vocab_size"] if bad_id == "past" else -1, 7
    tokens[position::16] = value
    np.save(shard, tokens)
    (folder / "metadata.json").write_text(json.dumps(metadata | {"dtype": "int32"}))
    return shard, value, position


@pytest.mark.parametrize("bad_id", ["past", "negative"])
def test_a_shard_with_ids_outside_the_vocabulary_is_one_error_naming_it(tiny_data, tmp_path, bad_id):
    shard, value, position = _damaged_copy(tiny_data, tmp_path / "data", bad_id)
    config = _config(tiny_data, tmp_path / "run", 2, data_stages=[_stage(tmp_path / "data", workers=1)])
    outcome = run_process("run_train.py", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, f"shard {shard} holds token id {value} at token {position}", "outside the vocabulary")


def test_a_shard_is_checked_once_when_opened_not_when_read(tiny_data, tmp_path):
    from nanotron.data.dataset import DataError, TokenShards

    _, value, position = _damaged_copy(tiny_data, tmp_path / "data", "past")
    with pytest.raises(DataError, match="outside the vocabulary"):
        TokenShards(tmp_path / "data")
    # The copy a data-loading worker opens (ids already checked) reads without scanning the tokens again.
    assert TokenShards(tmp_path / "data", ids_checked=True).read(position, 1).tolist() == [value]
