"""Hostile inputs that used to pass or to hang: YAML alias bombs, DoReMi weights resumed onto renamed or reordered
domains, initial weights trained with another tokenizer, and token ids outside the vocabulary in a shard.

Refusals go through the real entry points: ``run_train.py`` or ``python -m nanotron`` in a subprocess, or the same
``nanotron`` command in this process where a test needs it fast or repeatedly; each is exit status 2, one
``error:`` line naming the key or file, and no traceback.
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

from support import ROOT
from support.configs import DOMAINS, doremi_config, short_config, write_config
from support.corpus import without_id_ranges, write_corpus
from support.runs import Outcome, assert_user_error, cli


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
    pytest.param("data_stages: {laughs}\n", "data_stages[5]", marks=pytest.mark.slow),
], ids=["general.project", "data_stages"])
def test_nested_yaml_aliases_are_refused_at_once(tmp_path, document, key):
    import nanotron.trainer  # noqa: F401  (imported by the command before it reads the config: not timed)

    config = tmp_path / "laughs.yaml"
    config.write_text(document.format(laughs=_nested_aliases(7)))  # 9**7 = 4.8M values from 300 bytes
    fragments = (str(config), f"'{key}' holds more than 100,000 values once its YAML aliases", "write the values out")
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
    first = short_config(tiny_data, trained, 1)
    assert cli("train", "--config-file", write_config(tmp_path / "a.yaml", first)).code == 0
    corpus = write_corpus(tmp_path / "raw", documents=200, seed=5)
    other = train_tokenizer([corpus], 384, tmp_path / "other.json")
    assert load_tokenizer(other).get_vocab_size() == load_tokenizer(tiny_data["tokenizer"]).get_vocab_size()
    preprocess([corpus], other, tmp_path / "other_data", num_workers=1)
    config = short_config(tiny_data, tmp_path / "run", 2, tokenizer={"tokenizer_name_or_path": str(other)},
                          data_stages=[_stage(tmp_path / "other_data")])
    config["model"]["init_method"] = {"path": str(trained)}
    outcome = run_process("run_train.py", "--config-file", write_config(tmp_path / "init.yaml", config))
    assert_user_error(outcome, str(tmp_path / "other_data"), "another tokenizer", "checkpoints.allow_tokenizer_change")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    config["checkpoints"]["allow_tokenizer_change"] = True
    assert cli("train", "--config-file", write_config(tmp_path / "allowed.yaml", config)).code == 0


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
    config = short_config(tiny_data, tmp_path / "run", 2, data_stages=[_stage(tmp_path / "data", workers=1)])
    outcome = run_process("run_train.py", "--config-file", write_config(tmp_path / "config.yaml", config))
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


# --- DoReMi weights resumed onto other domains ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxy_run(tiny_data, doremi_domains, doremi_reference, tmp_path_factory) -> Path:
    """A DoReMi proxy over the domains animals, colours, rivers, stopped with a checkpoint at step 3."""
    run = tmp_path_factory.mktemp("proxy") / "run"
    config = doremi_config(tiny_data, doremi_domains, run, reference=doremi_reference, steps=3)
    assert cli("doremi", "train", "--config-file", write_config(run.parent / "proxy.yaml", config)).code == 0
    return run


def _resume_proxy(tiny_data, folders, reference, checkpoint: Path, run: Path, **doremi) -> Outcome:
    """One more step (4) of the proxy from ``checkpoint``, written to ``run``, by ``nanotron doremi train``."""
    config = doremi_config(tiny_data, folders, run, reference=reference, resume=checkpoint, steps=4, **doremi)
    return cli("doremi", "train", "--config-file", write_config(run.parent / f"{run.name}.yaml", config))


def _first_weights(run: Path) -> dict[str, float]:
    """The weights the first resumed step trained with, by domain: those the checkpoint saved."""
    (record,) = [json.loads(line) for line in (run / "domain_weights.jsonl").read_text().splitlines()]
    assert record["step"] == 4
    return record["weights"]


def _as_written_before(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of ``checkpoint`` holding its weights as checkpoints did before they were keyed by name: a list in the
    order of the domains of its config."""
    copy = tmp_path / "old"
    shutil.copytree(checkpoint, copy)
    metadata = json.loads((copy / "checkpoint.json").read_text())
    weights = metadata["domain_weights"]
    if isinstance(weights, dict):  # (a checkpoint of the code before the change already holds a list)
        metadata["domain_weights"] = [weights[name] for name in DOMAINS]
    # Those checkpoints were of format 2, which carried no manifest checksum.
    metadata.pop("manifest_sha256", None)
    metadata["format_version"] = 2
    (copy / "checkpoint.json").write_text(json.dumps(metadata))
    return copy


@pytest.mark.parametrize("written", ["by-name", "as-a-list-before"])
def test_resumed_domain_weights_follow_their_domain_when_the_folders_are_reordered(
        tiny_data, doremi_domains, doremi_reference, proxy_run, tmp_path, written):
    checkpoint = proxy_run / "3"
    if written == "as-a-list-before":
        checkpoint = _as_written_before(checkpoint, tmp_path)
    assert _resume_proxy(tiny_data, doremi_domains, doremi_reference, checkpoint, tmp_path / "same").code == 0
    assert _resume_proxy(tiny_data, doremi_domains[::-1], doremi_reference, checkpoint, tmp_path / "reversed").code == 0
    expected = _first_weights(tmp_path / "same")
    assert len(set(expected.values())) == len(DOMAINS)  # the weights moved apart: a swap would show
    assert _first_weights(tmp_path / "reversed") == expected


@pytest.mark.parametrize("written, change, fragments", [
    ("by-name", {"domain_names": ["animals", "colours", "lakes"]}, ("new: lakes", "gone: rivers")),
    ("by-name", {"folders": 2}, ("gone: rivers",)),
    ("as-a-list-before", {"domain_names": ["animals", "colours", "lakes"]}, ("new: lakes", "gone: rivers")),
], ids=["renamed", "removed", "renamed-as-a-list-before"])
@pytest.mark.slow
def test_resuming_domain_weights_onto_other_domains_is_refused(
        tiny_data, doremi_domains, doremi_reference, proxy_run, tmp_path, written, change, fragments):
    checkpoint = proxy_run / "3"
    if written == "as-a-list-before":
        checkpoint = _as_written_before(checkpoint, tmp_path)
    config = doremi_config(tiny_data, doremi_domains[:change.get("folders", 3)], tmp_path / "run",
                           reference=doremi_reference, resume=checkpoint, steps=4,
                           domain_names=change.get("domain_names"))
    outcome = run_process("-m", "nanotron", "doremi", "train", "--config-file",
                          write_config(tmp_path / "resume.yaml", config))
    assert_user_error(outcome, str(checkpoint), "data_stages[0].data.dataset.dataset_folder", *fragments)
    assert not (tmp_path / "run" / "domain_weights.jsonl").exists()


def test_domains_of_the_same_name_are_refused(tiny_data, doremi_domains, doremi_reference, tmp_path):
    config = doremi_config(tiny_data, doremi_domains, tmp_path / "run", reference=doremi_reference,
                           domain_names=["animals", "colours", "animals"])
    assert_user_error(cli("doremi", "train", "--config-file", write_config(tmp_path / "proxy.yaml", config)),
                      "'animals' names several domains", "give each its own name in doremi.domain_names")
