"""Hugging Face datasets (upstream's ``hf_dataset_or_datasets``), tokenized once into a cached preprocessed folder.

A dataset is a local ``save_to_disk`` folder, a local folder of data files (parquet, jsonl, ...; ``datasets`` infers
the format and the splits from the file names), or a name on the Hugging Face Hub when it is reachable. Its ``splits``
are concatenated in the order given, and the ``text_column`` of every row is one document, tokenized with our
tokenizer by ``datasets.map`` on ``num_proc`` processes and followed by the end-of-document id, exactly as
``nanotron preprocess`` does.

The tokens are written once as a preprocessed folder (``preprocess.write_token_folder``) under ``cache_folder``, in a
subfolder keyed by the dataset's fingerprint, the splits, the text column and the tokenizer's fingerprint; opening the
same dataset again reads that folder without tokenizing. The key leaves out the sequence length, since samples are
cut when read: one cache serves every sequence length. Samples are then those of any preprocessed folder
(``dataset.PretrainDataset``): windows of ``sequence_length + 1`` tokens sharing one token with their neighbours, as
upstream cuts Hugging Face datasets too, an exact resume and the same global batch at any layout.

A dataset of token ids (an ``input_ids`` column and no text column) is read as it is, without a tokenizer
(``pretokenized.py``: rows of one length are samples, as upstream's DoReMi datasets are read).

``datasets`` is the optional extra ``data``; without it, using a Hugging Face dataset is one error naming it.
"""

import hashlib
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanotron.data.dataset import DataError, PretrainDataset, TokenShards
from nanotron.data.preprocess import FORMAT_VERSION, METADATA_FILE_NAME, _BatchEncoder, write_token_folder
from nanotron.data.pretokenized import ArrowTokens, is_pretokenized
from nanotron.data.tokenizer import load_tokenizer, tokenizer_fingerprint

__all__ = ["HFDataset", "tokenize_hf_dataset"]

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install -e ".[data]"'
_DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".tsv", ".txt")
_BLANK_FILE_BYTES = 1 << 16  # larger text files are taken to hold rows, unread
_ROWS_PER_MAP_BATCH = 1000


def _datasets_library():
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading a Hugging Face dataset needs the datasets library: {INSTALL_HINT}") from None
    return datasets


@dataclass(frozen=True)
class _TokenizeColumn:
    """The ``datasets.map`` function: the ``text_column`` of a batch of rows -> their tokens (each followed by EOS; a
    missing text is an empty document)."""

    encoder: _BatchEncoder
    text_column: str

    def __call__(self, rows: dict[str, list]) -> dict[str, list[np.ndarray]]:
        tokens, lengths = self.encoder([text or "" for text in rows[self.text_column]])
        return {"input_ids": np.split(tokens, np.cumsum(lengths)[:-1])}


def _load_splits(dataset: str | Path, splits: Sequence[str], config_name: str | None) -> list:
    """The ``splits`` of ``dataset``, as ``datasets.Dataset`` objects, in the order given."""
    datasets = _datasets_library()
    path = Path(dataset)
    try:
        if (path / "state.json").is_file():  # a single split saved on its own is every split asked for
            return [_load_saved_split(datasets, path, dataset, "")]
        if (path / "dataset_dict.json").is_file():
            saved = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
            missing = [split for split in splits if split not in saved]
            if missing:
                raise DataError(f"the Hugging Face dataset {dataset} has no split {', '.join(missing)} (it has "
                                f"{', '.join(saved)}); set hf_dataset_splits to some of those")
            return [_load_saved_split(datasets, path / split, dataset, split) for split in splits]
        return list(datasets.load_dataset(str(dataset), config_name, split=list(splits)))
    except DataError:
        raise
    except Exception as error:
        if path.is_dir() and _data_files_without_rows(path):
            raise DataError(f"the Hugging Face dataset {dataset} has no rows: its data files are empty; give a "
                            "dataset with rows") from None
        reason = (str(error).strip().splitlines() or [""])[0]
        raise DataError(f"could not load the Hugging Face dataset {dataset} (splits {', '.join(splits)}): "
                        f"{type(error).__name__}: {reason}; give a save_to_disk folder, a folder of data files or a "
                        f"Hub name that is reachable") from None


def _load_saved_split(datasets, folder: Path, dataset: str | Path, split: str):
    """The split ``split`` of ``dataset`` that ``save_to_disk`` wrote to ``folder`` (each split of a DatasetDict has
    its own, as ``DatasetDict.load_from_disk`` reads them). A split of no rows is saved without a data file, which
    ``load_from_disk`` cannot load back (an IndexError): refused, naming it."""
    if json.loads((folder / "state.json").read_text(encoding="utf-8")).get("_data_files") == []:
        where, fix = (f" in split {split}", "hf_dataset_splits that hold rows") if split else (
            "", "a dataset with rows")
        raise DataError(f"the Hugging Face dataset {dataset} has no rows{where}; give {fix}")
    return datasets.load_from_disk(str(folder))


def _data_files_without_rows(folder: Path) -> bool:
    """Whether the data files of ``folder`` hold no row (empty text files, parquet files of no rows), which
    ``datasets.load_dataset`` fails to load (StopIteration, or "corresponds to no data")."""
    files = [file for file in folder.rglob("*") if file.suffix in _DATA_FILE_SUFFIXES and file.is_file()]

    def without_rows(file: Path) -> bool:
        if file.suffix == ".parquet":
            import pyarrow.parquet

            return pyarrow.parquet.read_metadata(file).num_rows == 0
        return file.stat().st_size < _BLANK_FILE_BYTES and not file.read_bytes().strip()

    return bool(files) and all(map(without_rows, files))


def _checked_text_column(dataset: str | Path, splits: Sequence[str], parts: list, text_column: str) -> None:
    """Refuse a dataset without rows or without text in ``text_column`` (null or empty in every row: it would train
    on end-of-document ids alone); warn of null texts among others, each of which becomes an empty document."""
    for part in parts:
        feature = part.features.get(text_column)
        if feature is None:
            raise DataError(f"the Hugging Face dataset {dataset} has no column {text_column!r} (it has "
                            f"{', '.join(part.column_names)}); set text_column_name to its text column")
        if getattr(feature, "dtype", None) not in ("string", "large_string", "null"):  # null: every row is null
            raise DataError(f"column {text_column!r} of the Hugging Face dataset {dataset} holds {feature}, not text; "
                            f"set text_column_name to its text column")
    rows = sum(part.num_rows for part in parts)
    if rows == 0:
        raise DataError(f"the Hugging Face dataset {dataset} has no rows in split {', '.join(splits)}; give "
                        f"hf_dataset_splits that hold rows")
    texts = [part.data.column(text_column) for part in parts]
    if sum(_non_empty(text) for text in texts) == 0:
        raise DataError(f"no row of the Hugging Face dataset {dataset} has text in column {text_column!r} (all "
                        f"{rows:,} are null or empty); set text_column_name to its text column")
    nulls = sum(text.null_count for text in texts)
    if nulls:
        logger.warning(f"{nulls:,} of the {rows:,} rows of the Hugging Face dataset {dataset} have no text (null in "
                       f"column {text_column!r}); each is an empty document: an end-of-document id alone")


def _non_empty(texts) -> int:
    """The number of texts (an Arrow column) that are neither null nor empty."""
    import pyarrow.compute

    if texts.null_count == len(texts):  # also a column of Arrow's null type, which holds no string
        return 0
    return pyarrow.compute.sum(pyarrow.compute.greater(pyarrow.compute.utf8_length(texts), 0)).as_py() or 0


def _cache_key(parts: list, splits: Sequence[str], text_column: str, fingerprint: str) -> str:
    identity = {"format_version": FORMAT_VERSION, "dataset_fingerprints": [part._fingerprint for part in parts],
                "splits": list(splits), "text_column": text_column, "tokenizer_fingerprint": fingerprint}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def _domain_folder_name(dataset: str | Path) -> str:
    """The cached folder's own name, which names the domain (in metrics): the dataset's last path component."""
    return re.sub(r"[^\w.-]+", "_", Path(str(dataset).rstrip("/")).name) or "dataset"


def tokenize_hf_dataset(dataset: str | Path, tokenizer: str | Path, *, splits: str | Sequence[str] = "train",
                        text_column: str = "text", config_name: str | None = None, num_proc: int = 1,
                        cache_folder: str | Path | None = None, overwrite_cache: bool = False) -> Path:
    """The preprocessed folder of ``dataset``'s ``splits`` tokenized with ``tokenizer``, built if not cached yet.

    ``cache_folder`` defaults to ``nanotron-tokenized`` in the ``datasets`` cache (``HF_DATASETS_CACHE``).
    ``overwrite_cache`` tokenizes again even if the folder exists. Processes that build the same folder at once all
    succeed (the first to finish provides it), but run it on one process first to tokenize only once.
    """
    splits = _split_list(dataset, splits)
    return _tokenized_folder(dataset, _load_splits(dataset, splits, config_name), tokenizer, splits=splits,
                             text_column=text_column, config_name=config_name, num_proc=num_proc,
                             cache_folder=cache_folder, overwrite_cache=overwrite_cache)


def _split_list(dataset: str | Path, splits: str | Sequence[str]) -> list[str]:
    splits = [splits] if isinstance(splits, str) else list(splits)
    if not splits:
        raise DataError(f"hf_dataset_splits is empty for {dataset}; name at least one split, e.g. train")
    return splits


def _tokenized_folder(dataset: str | Path, parts: list, tokenizer: str | Path, *, splits: list[str], text_column: str,
                      config_name: str | None, num_proc: int, cache_folder: str | Path | None,
                      overwrite_cache: bool) -> Path:
    """``tokenize_hf_dataset`` of the loaded splits ``parts``."""
    datasets = _datasets_library()
    if num_proc < 1:
        raise DataError(f"dataset_processing_num_proc_per_process must be at least 1, got {num_proc}")
    _checked_text_column(dataset, splits, parts, text_column)
    fingerprint = tokenizer_fingerprint(load_tokenizer(tokenizer))
    cache_root = Path(cache_folder) if cache_folder is not None else Path(datasets.config.HF_DATASETS_CACHE) / (
        "nanotron-tokenized")
    folder = cache_root / _cache_key(parts, splits, text_column, fingerprint) / _domain_folder_name(dataset)
    if (folder / METADATA_FILE_NAME).is_file() and not overwrite_cache:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    cache_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root, prefix=".map-") as map_cache:
        def encoded(encoder: _BatchEncoder) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for index, part in enumerate(parts):
                tokenized = part.map(_TokenizeColumn(encoder, text_column), batched=True,
                                     batch_size=_ROWS_PER_MAP_BATCH, num_proc=num_proc if num_proc > 1 else None,
                                     remove_columns=part.column_names, desc=f"tokenizing {dataset} ({splits[index]})",
                                     cache_file_name=str(Path(map_cache) / f"split-{index}.arrow"),
                                     load_from_cache_file=False)
                yield from _token_batches(tokenized)

        inputs = [f"{dataset}:{split}" for split in splits]
        try:
            write_token_folder(folder, tokenizer, encoded, inputs,
                               recorded={"hf_dataset": {"name": str(dataset), "splits": splits,
                                                        "text_column": text_column, "config_name": config_name}})
        except OSError:
            if not (folder / METADATA_FILE_NAME).is_file():
                raise  # not another process having completed the same folder first
    return folder


def _token_batches(tokenized) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document lengths) of the ``input_ids`` column, one Arrow chunk at a time, without a Python list."""
    for chunk in tokenized.data.column("input_ids").chunks:
        lengths = chunk.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
        yield chunk.flatten().to_numpy(zero_copy_only=False), lengths


class HFDataset(PretrainDataset):
    """The sample stream of one Hugging Face dataset, or of several blended by weight (``{name: weight}``, upstream's
    ``hf_dataset_or_datasets`` mapping), each tokenized once into a cached preprocessed folder
    (``tokenize_hf_dataset``, whose keyword arguments it takes) and read as ``PretrainDataset`` reads folders, or
    read as it is where it holds token ids (``pretokenized.py``)."""

    def __init__(self, datasets: str | Path | Mapping[str, float], tokenizer: str | Path, sequence_length: int,
                 seed: int, *, splits: str | Sequence[str] = "train", text_column: str = "text",
                 config_name: str | None = None, num_proc: int = 1, cache_folder: str | Path | None = None,
                 overwrite_cache: bool = False):
        if isinstance(datasets, Mapping):
            if not datasets:
                raise DataError("hf_dataset_or_datasets is empty; name at least one dataset")
            names, weights = list(datasets), [float(weight) for weight in datasets.values()]
            if not all(np.isfinite(weight) and weight > 0 for weight in weights):
                raise DataError(f"the weights of hf_dataset_or_datasets must all be positive numbers, got "
                                f"{dict(datasets)}")
        else:
            names, weights = [datasets], None
        self.dataset_names = [str(name) for name in names]
        streams = [_token_stream(name, tokenizer, sequence_length, splits=_split_list(name, splits),
                                 text_column=text_column, config_name=config_name, num_proc=num_proc,
                                 cache_folder=cache_folder, overwrite_cache=overwrite_cache) for name in names]
        super().__init__(streams, weights, sequence_length, seed, sources=self.dataset_names)


def _token_stream(dataset: str | Path, tokenizer: str | Path, sequence_length: int, *, splits: list[str],
                  config_name: str | None, **tokenizing) -> ArrowTokens | TokenShards:
    """The tokens of ``dataset``'s ``splits``: its ids as they are where it holds token ids, else its text tokenized
    into the cache (``tokenizing``: ``_tokenized_folder``'s settings)."""
    parts = _load_splits(dataset, splits, config_name)
    if is_pretokenized(parts, tokenizing["text_column"]):
        return ArrowTokens(dataset, parts, sequence_length)
    return TokenShards(_tokenized_folder(dataset, parts, tokenizer, splits=splits, config_name=config_name,
                                         **tokenizing))
