"""Upstream nanotron's data read directly: datatrove-tokenized folders, Hugging Face datasets and synthetic tokens,
and training reading each data stage from the source its config names (a Hugging Face dataset per domain as in
upstream's DoReMi layout); the domains keep apart in the metrics and on the step line at any layout, also folders of
one name.

The fixtures are written by the real libraries (datatrove's DocumentTokenizer, datasets' save_to_disk, parquet and
jsonl files) with the tiny test tokenizer; a test needing a library that is absent is skipped with the extra to
install.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from nanotron.data.dataset import BLEND_PERIOD, DataError, TokenShards
from nanotron.data.datatrove_folder import DatatroveDataset, DatatroveTokens
from nanotron.data.loader import MicroBatchLoader
from nanotron.data.preprocess import preprocess
from nanotron.data.synthetic import SyntheticDataset
from nanotron.data.tokenizer import eos_token_id, load_tokenizer, train_tokenizer
from support.configs import tiny_config_dict, write_config
from support.corpus import corpus_documents, datatrove_folder, pretokenized_domains, write_corpus
from support.runs import Outcome, assert_user_error, cli, metrics, train_on_ranks, train_through_cli

SEQUENCE_LENGTH = 16
SEED = 3
_DATASETS_REASON = 'the Hugging Face readers need datasets; pip install -e ".[data]"'


def _one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


# --------------------------------------------------------------------------------------------- datatrove folders


@pytest.fixture(scope="module")
def datatrove_folders(tiny_data, tmp_path_factory) -> list[Path]:
    """Two folders of the tiny corpus's halves: one file in document order; several shuffled files."""
    root = tmp_path_factory.mktemp("datatrove")
    documents = corpus_documents(tiny_data["corpus"])
    half = len(documents) // 2
    return [datatrove_folder(root / "first", documents[:half], tiny_data["tokenizer"], shuffle_documents=False),
            datatrove_folder(root / "second", documents[half:], tiny_data["tokenizer"], shuffle_documents=True,
                              seed=0, max_tokens_per_file=1500)]


def _file_windows(folder: Path, sequence_length: int) -> Counter:
    """Upstream's windows of a folder: each .ds file cut into disjoint runs of sequence_length + 1 tokens."""
    windows = Counter()
    for file in sorted(folder.glob("*.ds")):
        tokens = np.fromfile(file, dtype="<u2").astype(np.int64)
        for w in range(len(tokens) // (sequence_length + 1)):
            windows[tokens[w * (sequence_length + 1):(w + 1) * (sequence_length + 1)].tobytes()] += 1
    return windows


def _sample_windows(dataset, indices) -> Counter:
    return Counter(row.tobytes() for row in dataset.samples(list(indices))["tokens"].numpy())


def test_datatrove_files_hold_the_documents_our_tokenizer_makes(tiny_data, datatrove_folders):
    tokenizer = load_tokenizer(tiny_data["tokenizer"])
    eos = eos_token_id(tokenizer)
    expected = [token for text in corpus_documents(tiny_data["corpus"])[:200]
                for token in [*tokenizer.encode(text, add_special_tokens=False).ids, eos]]
    (file,) = datatrove_folders[0].glob("*.ds")
    assert np.fromfile(file, dtype="<u2").tolist() == expected
    assert len(list(datatrove_folders[1].glob("*.ds"))) > 1


def test_datatrove_samples_are_upstream_nanoset_windows(tiny_data, datatrove_folders):
    """One epoch visits every window of upstream's DatatroveFolderDataset once: per file, no token shared."""
    from datatrove.utils.dataset import DatatroveFolderDataset

    for folder in datatrove_folders:
        dataset = DatatroveDataset(folder, None, SEQUENCE_LENGTH, SEED, vocab_size=384)
        expected = _file_windows(folder, SEQUENCE_LENGTH)
        assert dataset.num_windows == [sum(expected.values())]
        assert _sample_windows(dataset, range(dataset.num_windows[0])) == expected
        upstream = DatatroveFolderDataset(str(folder), seq_len=SEQUENCE_LENGTH, filename_pattern="*.ds",
                                          recursive=False, token_size=2)
        assert Counter(upstream[i]["input_ids"].numpy().tobytes() for i in range(len(upstream))) == expected
        assert dataset.tokenizer_names == [str(tiny_data["tokenizer"])]  # datatrove records the name it was given
        reopened = pickle.loads(pickle.dumps(dataset))  # what a data-loading worker started by spawn receives
        assert torch.equal(reopened.samples(range(5))["tokens"], dataset.samples(range(5))["tokens"])


def test_datatrove_folders_blend_by_weight(datatrove_folders):
    dataset = DatatroveDataset(datatrove_folders, [1.0, 3.0], SEQUENCE_LENGTH, SEED, vocab_size=384)
    assert dataset.weights == [0.25, 0.75]
    batch = dataset.samples(range(64))
    assert Counter(batch["domain_ids"].tolist()) == {0: 16, 1: 48}  # the proportions hold in every small batch
    windows = [_file_windows(folder, SEQUENCE_LENGTH) for folder in datatrove_folders]
    for tokens, domain in zip(batch["tokens"].numpy(), batch["domain_ids"].tolist()):
        assert tokens.tobytes() in windows[domain]
    assert dataset.domain_names == ["first", "second"]
    domains = dataset.samples(range(BLEND_PERIOD))["domain_ids"]
    assert torch.bincount(domains).tolist() == [BLEND_PERIOD // 4, 3 * BLEND_PERIOD // 4]


def test_datatrove_ids_outside_the_vocabulary_name_the_file_and_its_tokenizer(tiny_data, datatrove_folders):
    (file,) = datatrove_folders[0].glob("*.ds")
    tokens = np.fromfile(file, dtype="<u2")
    largest, first = int(tokens.max()), int(tokens.argmax())
    with pytest.raises(DataError) as error:
        DatatroveDataset(datatrove_folders[0], None, SEQUENCE_LENGTH, SEED, vocab_size=largest)
    _one_line(error, f"file {file} holds token id {largest}", f"outside the {largest} ids of the model's vocabulary",
              f"the folder was tokenized with {tiny_data['tokenizer']}, whose ids go beyond the model's vocabulary")
    # The copy a data-loading worker opens, unchecked, names the file and the token in the window it reads.
    with pytest.raises(DataError) as error:
        DatatroveTokens(datatrove_folders[0], vocab_size=largest, id_share=None).read(first - 2, 4)
    _one_line(error, f"file {file} holds token id {largest} at token {first},", f"({largest} ids)")


def test_datatrove_empty_and_mismatched_folders_are_refused(datatrove_folders, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as error:
        DatatroveDataset(tmp_path / "empty", None, SEQUENCE_LENGTH, SEED, vocab_size=384)
    _one_line(error, f"{tmp_path / 'empty'} holds neither metadata.json", "nor .ds files")
    with pytest.raises(DataError) as error:
        DatatroveDataset(tmp_path / "absent", None, SEQUENCE_LENGTH, SEED, vocab_size=384)
    _one_line(error, f"dataset folder {tmp_path / 'absent'} does not exist")
    longest = max(file.stat().st_size // 2 for file in datatrove_folders[1].glob("*.ds"))
    with pytest.raises(DataError) as error:  # enough tokens in the folder, but no file holds a whole window
        DatatroveDataset(datatrove_folders[1], None, longest, SEED, vocab_size=384)
    _one_line(error, f"in files of at most {longest} tokens, fewer than one sample of sequence_length + 1")

    swapped = shutil.copytree(datatrove_folders[0], tmp_path / "swapped")
    (file,) = swapped.glob("*.ds")
    other = next(datatrove_folders[1].glob("*.ds"))
    shutil.copy(other.with_name(other.name + ".index"), file.with_name(file.name + ".index"))
    with pytest.raises(DataError) as error:
        DatatroveDataset(swapped, None, SEQUENCE_LENGTH, SEED, vocab_size=384)
    _one_line(error, f"{file}.index ends its last document at token", "tokens of 2 bytes", "do not belong together")

    renamed = shutil.copytree(datatrove_folders[1], tmp_path / "renamed")
    for metadata in renamed.glob("*.ds.metadata"):
        metadata.write_text(metadata.read_text().replace(metadata.read_text().split("|")[0], "another/tokenizer", 1))
    with pytest.raises(DataError) as error:
        DatatroveDataset([datatrove_folders[0], renamed], None, SEQUENCE_LENGTH, SEED, vocab_size=384)
    _one_line(error, "tokenized with different tokenizers", "another/tokenizer")

    with pytest.raises(DataError) as error:
        DatatroveDataset(datatrove_folders[0], None, SEQUENCE_LENGTH, SEED, vocab_size=384, token_size=4)
    _one_line(error, "token_size_in_bytes is 4", "2-byte tokens")


def test_datatrove_files_without_metadata_take_the_token_size_from_the_vocabulary(datatrove_folders, tmp_path):
    bare = shutil.copytree(datatrove_folders[1], tmp_path / "second")
    for metadata in bare.glob("*.ds.metadata"):
        metadata.unlink()
    expected = DatatroveDataset(datatrove_folders[1], None, SEQUENCE_LENGTH, SEED, vocab_size=384).samples(range(20))
    dataset = DatatroveDataset(bare, None, SEQUENCE_LENGTH, SEED, vocab_size=384)
    assert dataset.tokenizer_names == [None] and torch.equal(dataset.samples(range(20))["tokens"], expected["tokens"])
    with pytest.raises(DataError) as error:  # 2-byte tokens read as 4-byte ones: the index tells
        DatatroveDataset(bare, None, SEQUENCE_LENGTH, SEED, vocab_size=384, token_size=4)
    _one_line(error, ".ds.index ends its last document at token", "tokens of 4 bytes", "token_size_in_bytes")


def _train_config(tiny_data, tmp_path: Path, folder: Path, **dataset) -> dict:
    """One training step of the tiny model on ``folder``; ``dataset`` adds keys to data.dataset."""
    config = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 1})
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    config["data_stages"][0]["data"]["dataset"] = {"dataset_folder": [str(folder)], **dataset}
    return config


def _train(config: dict, tmp_path: Path) -> Outcome:
    return cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))


def _readable_folder_with(damage: str, datatrove_folders: list[Path], tmp_path: Path) -> tuple[Path, dict]:
    """A folder damaged as ``damage`` says, and the data.dataset keys that go with it."""
    if damage == "subfolders":
        shutil.copytree(datatrove_folders[0], tmp_path / "data" / "part-0")
        return tmp_path / "data", {}
    if damage == "empty":
        (tmp_path / "data").mkdir()
        return tmp_path / "data", {}
    folder = shutil.copytree(datatrove_folders[0], tmp_path / "data")
    if damage == "dangling-link":
        (folder / "zz.ds").symlink_to(tmp_path / "moved.ds")
    elif damage == "directory":
        (folder / "zz.ds").mkdir()
    return folder, {"vocab_size": 300} if damage == "ids-beyond-the-vocabulary" else {}


@pytest.mark.parametrize("damage, fragments", [
    ("dangling-link", ["zz.ds is a symbolic link to", "moved.ds, which does not exist", "remove the link"]),
    ("directory", ["zz.ds is not a file", "move it out of"]),
    ("empty", ["holds neither metadata.json (a folder of nanotron preprocess) nor .ds files (a folder of datatrove"]),
    ("subfolders", ["holds no .ds files itself, only in its subfolders (", "part-0)",
                    "read without their subfolders", "list those folders in dataset_folder"]),
    ("ids-beyond-the-vocabulary", ["outside the 300 ids of the model's vocabulary", "whose ids go beyond"]),
])
def test_a_datatrove_folder_that_cannot_be_trained_on_is_one_line(tiny_data, datatrove_folders, tmp_path, damage,
                                                                   fragments):
    folder, dataset = _readable_folder_with(damage, datatrove_folders, tmp_path)
    line = assert_user_error(_train(_train_config(tiny_data, tmp_path, folder, **dataset), tmp_path), str(folder),
                             *fragments)
    assert "not by a tokenizer" not in line and "not a preprocessed folder" not in line


# ------------------------------------------------------------------------- which tokenizer wrote a folder's tokens

HUB_NAME = "tiny-org/tiny-tokenizer"


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A tokenizer of the tiny one's size trained on another corpus: the same text gets other ids."""
    root = tmp_path_factory.mktemp("other_tokenizer")
    return train_tokenizer([write_corpus(root / "raw", documents=200, seed=5)], 384, root / "tokenizer.json")


def _hub_cache(tmp_path: Path, monkeypatch, tokenizer: Path | None) -> None:
    """A Hugging Face cache on this machine, holding ``tokenizer`` as the Hub's ``HUB_NAME`` (None: not holding it),
    laid out as huggingface_hub downloads it: a snapshot that refs/main names."""
    cache = tmp_path / "hub"
    if tokenizer is not None:
        repo = cache / ("models--" + HUB_NAME.replace("/", "--"))
        commit = "0123456789abcdef0123456789abcdef01234567"
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        shutil.copy(tokenizer, repo / "snapshots" / commit / "tokenizer.json")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))


def _record_tokenizer_name(folder: Path, name: str) -> None:
    """Rewrite the tokenizer that the folder's .ds.metadata files name, as datatrove writes a Hub name it was given."""
    for metadata in folder.glob("*.ds.metadata"):
        first, *rest = metadata.read_text().split("\n")
        metadata.write_text("\n".join([f"{name}|{first.rsplit('|', 1)[1]}", *rest]))


@pytest.mark.parametrize("kind", ["datatrove", "preprocessed"])
def test_a_folder_written_by_another_tokenizer_is_refused(tiny_data, other_tokenizer, tmp_path, kind):
    """Against tokenizer.tokenizer_name_or_path, by content: datatrove's metadata names the tokenizer, nanotron
    preprocess's records its fingerprint too; the two have the same size, so every id fits the model."""
    folder = tmp_path / "data"
    if kind == "datatrove":
        datatrove_folder(folder, corpus_documents(tiny_data["corpus"])[:40], other_tokenizer)
    else:
        preprocess([tiny_data["corpus"]], other_tokenizer, folder, num_workers=1)
    outcome = _train(_train_config(tiny_data, tmp_path, folder), tmp_path)
    assert_user_error(outcome, f"{folder} was tokenized with {other_tokenizer} but tokenizer.tokenizer_name_or_path "
                               f"is {tiny_data['tokenizer']}, another tokenizer (their tokenizer.json files differ)",
                      "set tokenizer.tokenizer_name_or_path to the tokenizer that wrote the data")
    assert not any((tmp_path / "run").iterdir())  # refused before the first step


SAME_TOKENIZER, OTHER_TOKENIZER, NOT_CACHED = "same", "other", "not cached"


@pytest.mark.parametrize("recorded, declared, cached, refused", [
    ("file", "folder", None, None),  # a tokenizer folder and the tokenizer.json inside it
    (HUB_NAME, HUB_NAME, SAME_TOKENIZER, None),  # a Hub name and its cached copy of the model's tokenizer
    (HUB_NAME, None, OTHER_TOKENIZER, "tokenizer.tokenizer_name_or_path is {tokenizer}, another tokenizer (their "
                                      "tokenizer.json files differ)"),
    (HUB_NAME, None, NOT_CACHED, None),  # not comparable: a warning
    (HUB_NAME, "folder", NOT_CACHED, "tokenizer_name is {folder}, another tokenizer (the names differ, and the "
                                     "files of one are not on this machine to compare)"),
], ids=["folder-and-its-file", "hub-name-cached", "hub-name-cached-differs", "hub-name-not-cached",
        "hub-name-not-cached-declared-otherwise"])
@pytest.mark.slow
def test_tokenizers_are_compared_by_content_not_by_name(tiny_data, datatrove_folders, other_tokenizer, tmp_path,
                                                        monkeypatch, recorded, declared, cached, refused):
    tokenizer, folder = tiny_data["tokenizer"], tiny_data["tokenizer"].parent
    data = shutil.copytree(datatrove_folders[0], tmp_path / "data")
    if recorded == HUB_NAME:
        _record_tokenizer_name(data, HUB_NAME)
    _hub_cache(tmp_path, monkeypatch, {SAME_TOKENIZER: tokenizer, OTHER_TOKENIZER: other_tokenizer}.get(cached))
    names = {"folder": str(folder), HUB_NAME: HUB_NAME}
    dataset = {} if declared is None else {"tokenizer_name": names[declared]}
    outcome = _train(_train_config(tiny_data, tmp_path, data, **dataset), tmp_path)
    if refused is not None:
        assert_user_error(outcome, f"{data} was tokenized with {HUB_NAME}",
                          refused.format(tokenizer=tokenizer, folder=folder))
        return
    assert outcome.code == 0, outcome.stderr[-3000:]
    assert (f"{data} was tokenized with {HUB_NAME}, whose files are not on this machine: its content was not "
            f"compared with tokenizer.tokenizer_name_or_path ({tokenizer})" in outcome.stderr) == (cached == NOT_CACHED)


# --------------------------------------------------------------------------------------------- Hugging Face datasets


@pytest.fixture(scope="module")
def hf_sources(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """The tiny corpus as a save_to_disk DatasetDict (train and validation), a parquet folder and a jsonl folder."""
    datasets = pytest.importorskip("datasets", reason=_DATASETS_REASON)
    root = tmp_path_factory.mktemp("hf")
    documents = corpus_documents(tiny_data["corpus"])
    train, validation = documents[:300], documents[300:]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train, "id": list(range(300))}),
                          "validation": datasets.Dataset.from_dict({"text": validation})}).save_to_disk(root / "saved")
    (root / "parquet").mkdir()
    datasets.Dataset.from_dict({"text": train}).to_parquet(root / "parquet" / "train-00000.parquet")
    (root / "jsonl").mkdir()
    (root / "jsonl" / "train.jsonl").write_text("".join(json.dumps({"body": text}) + "\n" for text in train))
    return {"root": root, "saved": root / "saved", "parquet": root / "parquet", "jsonl": root / "jsonl"}


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache for datasets' own files and the tokenized folders, outside the user's home."""
    datasets = pytest.importorskip("datasets", reason=_DATASETS_REASON)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "tokenized"


def _tokens(folder: Path) -> list[int]:
    shards = TokenShards(folder)
    return shards.read(0, shards.num_tokens).tolist()


@pytest.mark.slow
def test_hf_datasets_tokenize_as_nanotron_preprocess_does(tiny_data, hf_sources, hf_cache):
    from nanotron.data.hf_dataset import tokenize_hf_dataset

    preprocessed = _tokens(tiny_data["tokenized"])  # the whole corpus, by `nanotron preprocess`
    both = tokenize_hf_dataset(hf_sources["saved"], tiny_data["tokenizer"], splits=["train", "validation"],
                               num_proc=2, cache_folder=hf_cache)
    assert _tokens(both) == preprocessed
    train_only = _tokens(tokenize_hf_dataset(hf_sources["saved"], tiny_data["tokenizer"], cache_folder=hf_cache))
    assert preprocessed[:len(train_only)] == train_only and preprocessed[len(train_only)] != 0
    for source, column in (("parquet", "text"), ("jsonl", "body")):
        folder = tokenize_hf_dataset(hf_sources[source], tiny_data["tokenizer"], text_column=column,
                                     cache_folder=hf_cache)
        assert _tokens(folder) == train_only, source
        assert TokenShards(folder).name == source


def test_hf_tokenization_is_cached(tiny_data, hf_sources, hf_cache, monkeypatch):
    import datasets

    from nanotron.data.hf_dataset import HFDataset

    first = HFDataset(hf_sources["saved"], tiny_data["tokenizer"], SEQUENCE_LENGTH, SEED, cache_folder=hf_cache)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the dataset was tokenized again")

    monkeypatch.setattr(datasets.Dataset, "map", no_tokenizing)
    again = HFDataset(hf_sources["saved"], tiny_data["tokenizer"], SEQUENCE_LENGTH, SEED, cache_folder=hf_cache)
    assert torch.equal(again.samples(range(32))["tokens"], first.samples(range(32))["tokens"])
    longer = HFDataset(hf_sources["saved"], tiny_data["tokenizer"], 2 * SEQUENCE_LENGTH, SEED, cache_folder=hf_cache)
    assert longer._streams[0].folder == first._streams[0].folder  # another sequence length, the same cache
    with pytest.raises(AssertionError, match="tokenized again"):
        HFDataset(hf_sources["saved"], tiny_data["tokenizer"], SEQUENCE_LENGTH, SEED, cache_folder=hf_cache,
                  overwrite_cache=True)


def test_hf_tokenization_finished_first_by_another_process_is_used(tiny_data, hf_sources, hf_cache, monkeypatch):
    from nanotron.data import hf_dataset

    real = hf_dataset.write_token_folder

    def another_process_first(folder, *args, **kwargs):
        real(folder, *args, **kwargs)  # the other process renames its folder into place first
        (folder / "marker").touch()
        return real(folder, *args, **kwargs)  # this one's rename then fails: the folder is there

    monkeypatch.setattr(hf_dataset, "write_token_folder", another_process_first)
    folder = hf_dataset.tokenize_hf_dataset(hf_sources["parquet"], tiny_data["tokenizer"], cache_folder=hf_cache)
    assert (folder / "marker").is_file() and TokenShards(folder).num_tokens > 0
    assert [path.name for path in folder.parent.iterdir()] == [folder.name]  # no staging copy left behind


def test_hf_datasets_blend_by_weight_and_name_their_domains(tiny_data, hf_sources, hf_cache):
    from nanotron.data.hf_dataset import HFDataset

    dataset = HFDataset({str(hf_sources["parquet"]): 3.0, str(hf_sources["saved"]): 1.0}, tiny_data["tokenizer"],
                        SEQUENCE_LENGTH, SEED, cache_folder=hf_cache)
    assert dataset.domain_names == ["parquet", "saved"] and dataset.weights == [0.75, 0.25]
    assert Counter(dataset.samples(range(64))["domain_ids"].tolist()) == {0: 48, 1: 16}
    stream = np.array(_tokens(dataset._streams[0].folder))
    for g in range(8):  # windows of our kind: sequence_length + 1 tokens, neighbours sharing one
        tokens, domain = dataset.sample(g)
        if domain == 0:
            starts = [s for s in range(0, len(stream) - SEQUENCE_LENGTH, SEQUENCE_LENGTH)
                      if np.array_equal(stream[s:s + SEQUENCE_LENGTH + 1], tokens)]
            assert starts, g


def test_hf_dataset_errors_are_one_line(tiny_data, hf_sources, hf_cache, tmp_path):
    from nanotron.data.hf_dataset import HFDataset

    cases = [({"splits": "test"}, ["has no split test", "train, validation"]),
             ({"text_column": "content"}, ["has no column 'content'", "text, id"]),
             ({"text_column": "id"}, ["column 'id'", "not text"])]
    for options, fragments in cases:
        with pytest.raises(DataError) as error:
            HFDataset(hf_sources["saved"], tiny_data["tokenizer"], SEQUENCE_LENGTH, SEED, cache_folder=hf_cache,
                      **options)
        _one_line(error, *fragments)
    with pytest.raises(DataError) as error:
        HFDataset(tmp_path / "missing", tiny_data["tokenizer"], SEQUENCE_LENGTH, SEED, cache_folder=hf_cache)
    _one_line(error, f"could not load the Hugging Face dataset {tmp_path / 'missing'}")


def _saved(datasets, folder: Path, texts: list | None, **splits) -> Path:
    """A save_to_disk folder of ``texts`` (a text column, null values included), or of the datasets ``splits``."""
    features = datasets.Features({"text": datasets.Value("string")})
    if texts is not None:
        datasets.Dataset.from_dict({"text": texts}, features=features).save_to_disk(folder)
    else:
        datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": rows}, features=features)
                              for name, rows in splits.items()}).save_to_disk(folder)
    return folder


@pytest.mark.slow
def test_hf_datasets_without_rows_or_text_are_one_line(tiny_data, hf_cache, tmp_path):
    from nanotron.data.hf_dataset import HFDataset

    datasets = pytest.importorskip("datasets", reason=_DATASETS_REASON)
    filtered = tmp_path / "filtered"
    datasets.Dataset.from_dict({"text": ["a b", "c d"]}).filter(lambda row: False).save_to_disk(filtered)
    (tmp_path / "blank_jsonl").mkdir()
    (tmp_path / "blank_jsonl" / "train.jsonl").write_text("")
    (tmp_path / "parquet").mkdir()
    datasets.Dataset.from_dict({"text": ["a"]}).filter(lambda row: False).to_parquet(tmp_path / "parquet" / "a.parquet")
    null_typed = tmp_path / "null_typed"
    datasets.Dataset.from_dict({"text": [None, None]}).save_to_disk(null_typed)  # Arrow's null type, no string
    cases = [
        (_saved(datasets, tmp_path / "no_rows", []), {}, "has no rows; give a dataset with rows"),
        (filtered, {}, "has no rows in split train; give hf_dataset_splits that hold rows"),
        (_saved(datasets, tmp_path / "split", None, train=["a b"] * 50, validation=[]), {"splits": "validation"},
         "has no rows in split validation"),
        (tmp_path / "blank_jsonl", {}, "has no rows: its data files are empty"),
        (tmp_path / "parquet", {}, "has no rows: its data files are empty"),
        (_saved(datasets, tmp_path / "null", [None] * 3000), {}, "has text in column 'text' (all 3,000 are null"),
        (_saved(datasets, tmp_path / "blank", ["", None]), {}, "has text in column 'text' (all 2 are null or empty)"),
        (null_typed, {}, "has text in column 'text' (all 2 are null or empty); set text_column_name"),
    ]
    for folder, options, fragment in cases:
        with pytest.raises(DataError) as error:
            HFDataset(folder, tiny_data["tokenizer"], SEQUENCE_LENGTH, SEED, cache_folder=hf_cache, **options)
        _one_line(error, f"the Hugging Face dataset {folder} ", fragment)
    # A split without rows beside those asked for is never loaded.
    assert HFDataset(tmp_path / "split", tiny_data["tokenizer"], 4, SEED, cache_folder=hf_cache).num_windows


def test_hf_null_texts_among_others_are_empty_documents_counted_in_a_warning(tiny_data, hf_cache, tmp_path, caplog):
    from nanotron.data.hf_dataset import tokenize_hf_dataset

    datasets = pytest.importorskip("datasets", reason=_DATASETS_REASON)
    documents = corpus_documents(tiny_data["corpus"])[:40]
    with_nulls = _saved(datasets, tmp_path / "nulls", [None, *documents[:20], None, None, *documents[20:]])
    with_empty = _saved(datasets, tmp_path / "empty", ["", *documents[:20], "", "", *documents[20:]])
    with caplog.at_level(logging.WARNING, logger="nanotron"):
        folder = tokenize_hf_dataset(with_nulls, tiny_data["tokenizer"], cache_folder=hf_cache)
    assert caplog.messages == [f"3 of the 43 rows of the Hugging Face dataset {with_nulls} have no text (null in "
                               "column 'text'); each is an empty document: an end-of-document id alone"]
    assert _tokens(folder) == _tokens(tokenize_hf_dataset(with_empty, tiny_data["tokenizer"], cache_folder=hf_cache))


@pytest.fixture(scope="module")
def doremi_domains(tiny_data, tmp_path_factory) -> Path:
    """Two domains tokenized into rows of SEQUENCE_LENGTH + 1 int32 ids with their domain_ids, each saved by
    save_to_disk in a folder of its name: upstream's DoReMi datasets."""
    documents = corpus_documents(tiny_data["corpus"])
    return pretokenized_domains(tmp_path_factory.mktemp("doremi") / "the_pile",
                                {"Pile-CC": documents[::2], "Github": documents[1::2]}, tiny_data["tokenizer"],
                                SEQUENCE_LENGTH)


def test_a_pretokenized_dataset_is_read_row_by_row_as_upstreams_doremi_reads_it(tiny_data, doremi_domains,
                                                                                 hf_cache):
    """No tokenizer, no cache: every sample is one row, each row a sample once per epoch."""
    import datasets

    from nanotron.data.hf_dataset import HFDataset

    names = ["Pile-CC", "Github"]
    rows = [datasets.load_from_disk(doremi_domains / name)["input_ids"] for name in names]
    dataset = HFDataset({str(doremi_domains / name): 1.0 for name in names}, tiny_data["tokenizer"],
                        SEQUENCE_LENGTH, SEED, cache_folder=hf_cache)
    assert dataset.domain_names == names and dataset.num_windows == [len(domain) for domain in rows]
    assert dataset.tokenizer_fingerprints == [None, None] and not hf_cache.exists()
    batch = dataset.samples(range(2 * min(dataset.num_windows)))  # within one epoch of each domain
    seen = Counter(zip(batch["domain_ids"].tolist(), map(tuple, batch["tokens"].tolist())))
    every_row = {(domain, tuple(row)) for domain, domain_rows in enumerate(rows) for row in domain_rows}
    assert set(seen) <= every_row and max(seen.values()) == 1
    smaller = int(np.argmin(dataset.num_windows))
    assert {tokens for domain, tokens in seen if domain == smaller} == set(map(tuple, rows[smaller]))


def test_pretokenized_rows_of_several_lengths_are_documents_of_one_stream(tiny_data, hf_cache, tmp_path):
    """Any integer type; the documents follow each other as written and are cut like tokenized text."""
    datasets = pytest.importorskip("datasets", reason=_DATASETS_REASON)
    from nanotron.data.hf_dataset import HFDataset

    documents = [list(range(start, start + length)) for start, length in ((1, 7), (50, 30), (100, 12))]
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("uint16"))})
    datasets.Dataset.from_dict({"input_ids": documents}, features=features).save_to_disk(tmp_path / "documents")
    dataset = HFDataset(tmp_path / "documents", tiny_data["tokenizer"], 8, SEED, cache_folder=hf_cache)
    stream = [token for document in documents for token in document]
    assert dataset.num_windows == [(len(stream) - 9) // 8 + 1] and dataset.vocab_size == max(stream) + 1
    windows = {tuple(stream[start:start + 9]) for start in range(0, len(stream) - 8, 8)}
    assert {tuple(tokens) for tokens in dataset.samples(range(dataset.num_windows[0]))["tokens"].tolist()} == windows


def test_pretokenized_rows_shorter_than_a_sample_are_one_line_naming_the_sequence_length(tiny_data, doremi_domains,
                                                                                          hf_cache):
    from nanotron.data.hf_dataset import HFDataset

    with pytest.raises(DataError) as error:
        HFDataset(doremi_domains / "Github", tiny_data["tokenizer"], 2 * SEQUENCE_LENGTH, SEED, cache_folder=hf_cache)
    _one_line(error, f"the Hugging Face dataset {doremi_domains / 'Github'} holds rows of {SEQUENCE_LENGTH + 1} token "
                     f"ids (input_ids), each one sample, shorter than tokens.sequence_length + 1 "
                     f"({2 * SEQUENCE_LENGTH + 1}); set tokens.sequence_length to {SEQUENCE_LENGTH} or lower")


def test_a_missing_datasets_library_is_named_with_its_extra(tiny_data, monkeypatch, tmp_path):
    from nanotron.data.hf_dataset import HFDataset

    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` meets without the library
    with pytest.raises(DataError) as error:
        HFDataset(tmp_path, tiny_data["tokenizer"], SEQUENCE_LENGTH, SEED)
    _one_line(error, "needs the datasets library", 'pip install -e ".[data]"')


# --------------------------------------------------------------------------------------------- synthetic tokens


def test_synthetic_tokens_are_a_pure_function_of_seed_and_index():
    dataset = SyntheticDataset(vocab_size=50, sequence_length=SEQUENCE_LENGTH, seed=SEED)
    batch = dataset.samples(range(40))["tokens"]
    assert batch.shape == (40, SEQUENCE_LENGTH + 1) and batch.dtype == torch.int64
    assert torch.equal(SyntheticDataset(50, SEQUENCE_LENGTH, SEED).samples([39, 7])["tokens"], batch[[39, 7]])
    assert torch.equal(torch.from_numpy(dataset.sample(12)[0]), batch[12])
    assert not torch.equal(SyntheticDataset(50, SEQUENCE_LENGTH, SEED + 1).samples(range(40))["tokens"], batch)
    assert len(set(map(tuple, batch.tolist()))) == 40  # samples differ from each other
    assert set(batch.flatten().tolist()) == set(range(50))  # the whole vocabulary, nothing outside it
    assert dataset.samples(range(4))["domain_ids"].tolist() == [0, 0, 0, 0]


# --------------------------------------------------------------------------------------------- resume and layout


def _steps(dataset, first_sample: int, steps: int, dp_size: int = 1) -> list[torch.Tensor]:
    """The global batches (4 samples) of ``steps`` steps, gathered over ``dp_size`` ranks."""
    loaders = [MicroBatchLoader(dataset, first_sample=first_sample, start_step=0, micro_batch_size=4 // dp_size // 2,
                                accumulation=2, dp_rank=rank, dp_size=dp_size)
               for rank in range(dp_size)]
    return [torch.cat([micro.input_ids for loader in loaders for micro in loader.next_step()])
            for _ in range(steps)]


@pytest.mark.parametrize("source", ["datatrove", "hf", "synthetic"])
def test_every_source_resumes_exactly_and_ignores_the_layout(source, request, tiny_data, tmp_path):
    def build():
        if source == "datatrove":
            return DatatroveDataset(request.getfixturevalue("datatrove_folders"), [1.0, 2.0], SEQUENCE_LENGTH, SEED,
                                    vocab_size=384)
        if source == "hf":
            from nanotron.data.hf_dataset import HFDataset

            return HFDataset(request.getfixturevalue("hf_sources")["saved"], tiny_data["tokenizer"], SEQUENCE_LENGTH,
                             SEED, cache_folder=request.getfixturevalue("hf_cache"))
        return SyntheticDataset(384, SEQUENCE_LENGTH, SEED)

    straight = _steps(build(), first_sample=0, steps=5)
    resumed = _steps(build(), first_sample=3 * 4, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(straight[3:], resumed))
    assert all(torch.equal(a, b) for a, b in zip(straight, _steps(build(), first_sample=0, steps=5, dp_size=2)))
    assert not torch.equal(straight[0], straight[1])


# --------------------------------------------------------------------------------------------- the table of sources


@pytest.mark.parametrize("kind", ["preprocessed", "datatrove", "hf", "synthetic"])
def test_each_kind_of_source_is_one_row_answering_its_domains_sources_and_document_end(kind, request, tiny_data):
    """``build_source`` picks the builder by the class of the settings; the source it returns says what each domain
    is read from (as written) and which id ends its documents: recorded by a preprocessed folder, else the
    tokenizer's (datatrove), else, for synthetic tokens, the model's."""
    from nanotron.config import DatasetArgs, HFDatasetArgs
    from nanotron.data.sources import SOURCES, SourceContext, build_source

    eos = eos_token_id(load_tokenizer(tiny_data["tokenizer"]))
    tokenizer = {"tokenizer": str(tiny_data["tokenizer"]), "tokenizer_eos_token_id": eos}
    settings, context, sources = None, SourceContext(SEQUENCE_LENGTH, SEED, 384, model_eos_token_id=eos), []
    if kind in ("preprocessed", "datatrove"):
        sources = ([tiny_data["tokenized"]] if kind == "preprocessed" else request.getfixturevalue("datatrove_folders"))
        settings = DatasetArgs(dataset_folder=sources)
        context = SourceContext(SEQUENCE_LENGTH, SEED, 384, **(tokenizer if kind == "datatrove" else {}))
    elif kind == "hf":
        request.getfixturevalue("hf_cache")
        hf = request.getfixturevalue("hf_sources")
        sources = [hf["saved"], hf["parquet"]]
        settings = HFDatasetArgs(hf_dataset_or_datasets={str(path): 1.0 for path in sources})
        context = SourceContext(SEQUENCE_LENGTH, SEED, 384, **tokenizer)
    source = build_source(settings, context)
    assert type(settings) in SOURCES
    assert source.domain_sources == ([str(path) for path in sources] or ["synthetic tokens"])
    assert len(source.domain_names) == len(source.domain_sources) and source.eos_token_id == eos


# ------------------------------------------------------------------------------------- training on each kind of source

@pytest.fixture
def domains_on_disk(tiny_data, tmp_path, monkeypatch):
    """Two domains saved by ``datasets`` under one folder, as upstream's DoReMi examples keep theirs."""
    datasets = pytest.importorskip("datasets", reason='the Hugging Face readers need it: pip install -e ".[data]"')
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    documents = corpus_documents(tiny_data["corpus"])
    for name, part in (("Wikipedia (en)", documents[::2]), ("Github", documents[1::2])):
        datasets.Dataset.from_dict({"text": part}).save_to_disk(tmp_path / "domains" / name)
    return tmp_path / "domains"


@pytest.mark.slow
def test_a_hugging_face_dataset_per_domain_trains_with_its_domains(tiny_data, domains_on_disk, tmp_path):
    run = tmp_path / "run"
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": 2}, doremi={  # mixed by weight, no proxy
        "domain_names": "Wikipedia (en), Github", "domain_weights": [0.75, 0.25]})
    config["data_stages"][0]["data"]["dataset"] = {"hf_dataset_or_datasets": str(domains_on_disk),
                                                   "hf_dataset_splits": "train", "text_column_name": "text"}
    train_through_cli(config, tmp_path / "config.yaml")
    records = metrics(run)
    assert [record["step"] for record in records] == [1, 2]
    assert set(records[0]["domain_losses"]) == {"Wikipedia (en)", "Github"}, records[0]
    assert all(loss > 0 for loss in records[-1]["domain_losses"].values())


@pytest.mark.slow
def test_a_pretokenized_dataset_trains_in_a_plain_stage_and_rows_too_short_are_one_line(tiny_data, doremi_domains,
                                                                                         tmp_path, monkeypatch):
    """Rows of SEQUENCE_LENGTH + 1 ids train at that sequence length; at a longer one the run stops before its first
    step with one line naming the dataset and the key."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))

    def config(run: str, sequence_length: int) -> Path:
        written = tiny_config_dict(tiny_data, tmp_path / run, tokens={"train_steps": 2,
                                                                      "sequence_length": sequence_length})
        written["data_stages"][0]["data"]["dataset"] = {"hf_dataset_or_datasets": str(doremi_domains / "Github")}
        return write_config(tmp_path / f"{run}.yaml", written)

    assert cli("train", "--config-file", config("run", SEQUENCE_LENGTH)).code == 0
    assert [record["step"] for record in metrics(tmp_path / "run")] == [1, 2]
    assert_user_error(cli("train", "--config-file", config("longer", 2 * SEQUENCE_LENGTH)),
                      f"the Hugging Face dataset {doremi_domains / 'Github'} holds rows of {SEQUENCE_LENGTH + 1} "
                      "token ids", f"set tokens.sequence_length to {SEQUENCE_LENGTH} or lower")
    assert not (tmp_path / "longer").exists() or not any((tmp_path / "longer").iterdir())


def test_a_null_dataset_trains_on_synthetic_tokens(tiny_data, tmp_path):
    run = tmp_path / "run"
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": 2})
    config["data_stages"][0]["data"]["dataset"] = None
    train_through_cli(config, tmp_path / "config.yaml")
    assert [record["step"] for record in metrics(run)] == [1, 2]


def test_a_hugging_face_dataset_whose_texts_are_all_null_is_refused(tiny_data, tmp_path, monkeypatch):
    """It trained on end-of-document ids alone, and exited 0."""
    datasets = pytest.importorskip("datasets", reason='the Hugging Face readers need it: pip install -e ".[data]"')
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    folder = tmp_path / "null_texts"
    datasets.Dataset.from_dict({"text": [None] * 3000}, features=datasets.Features(
        {"text": datasets.Value("string")})).save_to_disk(folder)
    config = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 2})
    config["data_stages"][0]["data"]["dataset"] = {"hf_dataset_or_datasets": str(folder), "text_column_name": "text"}
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      f"no row of the Hugging Face dataset {folder} has text in column 'text' (all 3,000 are null or "
                      "empty); set text_column_name to its text column")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_folders_of_one_name_are_apart_in_the_metrics_and_on_the_step_line(tiny_data, tmp_path):
    """They were one domain, "web", their losses merged."""
    folders = [tmp_path / "a" / "web", tmp_path / "b" / "web"]
    for folder in folders:
        shutil.copytree(tiny_data["tokenized"], folder)
    run = tmp_path / "run"
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": 2})
    config["data_stages"][0]["data"]["dataset"] = {"dataset_folder": [str(folder) for folder in folders]}
    outcome = train_through_cli(config, tmp_path / "config.yaml")
    assert all(set(record["domain_losses"]) == {"a/web", "b/web"} for record in metrics(run)), metrics(run)
    step_lines = [line for line in outcome.stderr.splitlines() if "| a/web " in line and "| b/web " in line]
    assert len(step_lines) == 2, outcome.stderr[-3000:]


@pytest.fixture(scope="module")
def two_domains(tiny_data, tmp_path_factory) -> list[Path]:
    """The tiny corpus and a second domain tokenized with the same tokenizer: 'tokenized' and 'other'."""
    from nanotron.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("domains")
    corpus = write_corpus(root / "raw", documents=200, seed=1)
    preprocess([corpus], tiny_data["tokenizer"], root / "other", num_workers=1)
    return [tiny_data["tokenized"], root / "other"]


@pytest.mark.full_tier
def test_multi_folder_runs_log_the_loss_of_every_domain_at_any_layout(tiny_data, two_domains, tmp_path):
    stage = {"name": "main", "start_training_step": 1,
             "data": {"seed": 3, "num_loading_workers": 0,
                      "dataset": {"dataset_folder": [str(f) for f in two_domains], "dataset_weights": [0.5, 0.5]}}}
    single = tiny_config_dict(tiny_data, tmp_path / "single", data_stages=[stage], tokens={"train_steps": 4})
    split = tiny_config_dict(tiny_data, tmp_path / "split", data_stages=[stage], parallelism={"dp": 2, "pp": 2},
                             tokens={"train_steps": 4, "micro_batch_size": 2})
    reference = train_on_ranks(single, 1)
    layout = train_on_ranks(split, 4)
    for record in reference:
        losses = record["domain_losses"]
        assert set(losses) == {"tokenized", "other"}
        assert min(losses.values()) <= record["lm_loss"] <= max(losses.values())
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"]
    for ours, theirs in zip(layout, reference):
        assert ours["domain_losses"] == pytest.approx(theirs["domain_losses"], rel=1e-5)
