"""Tokenize raw text files into a preprocessed folder, the on-disk format that training reads.

A preprocessed folder holds one token stream: every document's tokens followed by the end-of-document id,
documents in input order, cut into ``.npy`` shards that training memory-maps. Tokenizing happens once, here,
instead of on every training rank, and the output only depends on the inputs and the tokenizer, never on how
many worker processes tokenized them, so a folder can always be rebuilt bit for bit.

Layout of ``<output_folder>``::

    metadata.json          format version, tokenizer identity, dtype, token/document counts, shard list (with
                           each shard's smallest and largest id), inputs
    tokens-00000.npy       token ids (uint16 if the vocabulary fits, else uint32); all shards but the last hold
    tokens-00001.npy       exactly ``tokens_per_shard`` tokens, so documents may continue into the next shard
    documents-00000.npy    int64 end offsets, counted from the start of the whole stream, of the documents
    documents-00001.npy    whose last token (the end-of-document id) lies in that shard
"""

import json
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

# The readers live in documents so that tokenizer can use them without importing this module; they stay
# importable from here (nanotron.data.dataset takes DataError from here).
from nanotron.data.documents import DataError, iter_documents, list_input_files
from nanotron.data.tokenizer import eos_token_id, load_tokenizer, tokenizer_fingerprint

FORMAT_VERSION = 1
METADATA_FILE_NAME = "metadata.json"
# Documents are sent to the workers in batches: large enough to amortise the inter-process transfer, small
# enough to keep every worker busy and the memory in flight bounded.
_BATCH_DOCUMENTS = 512
_BATCH_CHARACTERS = 1 << 22


def held_out(index: int, every: int | None) -> bool:
    """Whether document ``index`` (counted over all inputs, in order) belongs to the held-out split: every
    ``every``-th one, so both splits sample the whole input evenly."""
    return every is not None and index % every == every - 1


def _document_batches(files: Sequence[Path], text_key: str, split: str | None = None,
                      held_out_every: int | None = None) -> Iterator[list[str]]:
    """The documents of ``files`` in order (only those of ``split``, when given), grouped into batches bounded in
    count and characters."""
    batch: list[str] = []
    characters = 0
    documents = (document for file in files for document in iter_documents(file, text_key))
    for index, document in enumerate(documents):
        if split is not None and held_out(index, held_out_every) != (split == "held-out"):
            continue
        batch.append(document)
        characters += len(document)
        if len(batch) >= _BATCH_DOCUMENTS or characters >= _BATCH_CHARACTERS:
            yield batch
            batch, characters = [], 0
    if batch:
        yield batch


@dataclass(frozen=True)
class _BatchEncoder:
    """Turns a batch of documents into their tokens (each followed by EOS) and per-document token counts."""

    tokenizer: Tokenizer
    eos_token_id: int
    dtype: str

    def __call__(self, documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self.tokenizer.encode_batch(documents, add_special_tokens=False)
        token_ids: list[int] = []
        for encoding in encodings:
            token_ids.extend(encoding.ids)
            token_ids.append(self.eos_token_id)
        lengths = np.array([len(encoding.ids) + 1 for encoding in encodings], dtype=np.int64)
        return np.array(token_ids, dtype=self.dtype), lengths


_worker_encoder: _BatchEncoder | None = None


def _start_worker(encoder: _BatchEncoder) -> None:
    global _worker_encoder
    # Parallelism comes from the worker processes; threads inside each would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = encoder


def _encode_in_worker(documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_encoder is not None, "_start_worker did not run in this process"
    return _worker_encoder(documents)


def _encoded_batches(batches: Iterable[list[str]], encoder: _BatchEncoder,
                     num_workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode ``batches`` on ``num_workers`` processes, yielding results in input order.

    At most two batches per worker are in flight, so memory stays bounded however large the inputs are.
    Workers are spawned rather than forked: forking a process whose tokenizer thread pool is running is unsafe.
    """
    if num_workers == 1:
        yield from map(encoder, batches)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_workers, mp_context=context, initializer=_start_worker,
                             initargs=(encoder,)) as pool:
        pending = deque()
        for batch in batches:
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class _ShardWriter:
    """Appends tokens to a stream cut into shards of exactly ``tokens_per_shard`` tokens (the last one shorter)."""

    def __init__(self, folder: Path, dtype: np.dtype, tokens_per_shard: int):
        self._folder = folder
        self._buffer = np.empty(tokens_per_shard, dtype=dtype)  # pages are only allocated once written
        self._filled = 0
        self._written = 0
        self._unwritten_document_ends: list[np.ndarray] = []
        self.num_tokens = 0
        self.num_documents = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray, document_lengths: np.ndarray) -> None:
        self._unwritten_document_ends.append(self.num_tokens + np.cumsum(document_lengths))
        self.num_tokens += len(tokens)
        self.num_documents += len(document_lengths)
        offset = 0
        while offset < len(tokens):
            count = min(len(tokens) - offset, len(self._buffer) - self._filled)
            self._buffer[self._filled:self._filled + count] = tokens[offset:offset + count]
            self._filled += count
            offset += count
            if self._filled == len(self._buffer):
                self._write_shard()

    def close(self) -> list[dict]:
        if self._filled:
            self._write_shard()
        return self.shards

    def _write_shard(self) -> None:
        index = len(self.shards)
        shard_end = self._written + self._filled
        document_ends = np.concatenate(self._unwritten_document_ends)
        inside = document_ends <= shard_end
        self._unwritten_document_ends = [document_ends[~inside]]
        tokens = self._buffer[:self._filled]
        # The id range lets training check the shard against the vocabulary without reading it (dataset.TokenShards).
        shard = {"tokens": f"tokens-{index:05d}.npy", "documents": f"documents-{index:05d}.npy",
                 "num_tokens": self._filled, "num_documents": int(inside.sum()),
                 "min_token_id": int(tokens.min()), "max_token_id": int(tokens.max())}
        np.save(self._folder / shard["tokens"], tokens)
        np.save(self._folder / shard["documents"], document_ends[inside])
        self.shards.append(shard)
        self._written = shard_end
        self._filled = 0


def preprocess(inputs: Sequence[Path], tokenizer: str | Path, output_folder: Path, text_key: str = "text",
               num_workers: int | None = None, tokens_per_shard: int = 1 << 28, split: str | None = None,
               held_out_every: int | None = None) -> dict:
    """Tokenize every document of ``inputs`` into the preprocessed folder ``output_folder``; return its metadata.

    With ``held_out_every=N``, ``split="held-out"`` keeps every N-th document and ``split="train"`` the others, so
    two runs on the same inputs give a training folder and an evaluation folder that share no document.

    No special tokens are added inside documents; the end-of-document id follows every document. The output is
    byte-identical for any ``num_workers`` (default: all CPUs).
    """
    num_workers = (os.cpu_count() or 1) if num_workers is None else num_workers
    if num_workers < 1:
        raise DataError(f"--num-workers must be at least 1, got {num_workers}")
    if tokens_per_shard < 1:
        raise DataError(f"tokens_per_shard must be at least 1, got {tokens_per_shard}")
    if (split is None) != (held_out_every is None) or (held_out_every is not None and held_out_every < 2):
        raise DataError("give --split (train or held-out) together with --held-out-every N, N >= 2")
    output_folder = Path(output_folder)
    if output_folder.exists() and (not output_folder.is_dir() or any(output_folder.iterdir())):
        raise DataError(f"output folder {output_folder} already exists and is not empty; choose another "
                        f"--output-folder or delete it")
    files = list_input_files(inputs)

    def encoded(encoder: _BatchEncoder) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return _encoded_batches(_document_batches(files, text_key, split, held_out_every), encoder, num_workers)

    recorded = {} if split is None else {"split": {"name": split, "held_out_every": held_out_every}}
    return write_token_folder(output_folder, tokenizer, encoded, [str(file) for file in files], tokens_per_shard,
                              recorded)


def write_token_folder(output_folder: Path, tokenizer: str | Path,
                       encoded: Callable[[_BatchEncoder], Iterable[tuple[np.ndarray, np.ndarray]]],
                       inputs: Sequence[str], tokens_per_shard: int = 1 << 28, recorded: dict | None = None) -> dict:
    """Write the preprocessed folder ``output_folder`` from ``encoded(encoder)``: the (tokens, document lengths) of
    the documents in order, as ``encoder`` (tokenizer ``tokenizer``) makes them. Returns its metadata, which also
    records ``inputs`` and ``recorded``.

    The folder is built under a hidden sibling name and renamed into place at the end, so an interrupted run never
    leaves a folder that looks complete; the rename fails (OSError) if another process completed the folder first.
    """
    loaded_tokenizer = load_tokenizer(tokenizer)
    eos = eos_token_id(loaded_tokenizer)
    vocab_size = loaded_tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32)
    encoder = _BatchEncoder(loaded_tokenizer, eos, dtype.name)

    output_folder.parent.mkdir(parents=True, exist_ok=True)
    staging = output_folder.with_name(f".{output_folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)  # left over by a killed run that had the same process id
    staging.mkdir()
    try:
        writer = _ShardWriter(staging, dtype, tokens_per_shard)
        with tqdm(desc=f"preprocessing {output_folder.name}", unit="doc") as progress:
            for tokens, document_lengths in encoded(encoder):
                writer.add(tokens, document_lengths)
                progress.update(len(document_lengths))
                progress.set_postfix(tokens=writer.num_tokens, refresh=False)
        shards = writer.close()
        if writer.num_documents == 0:
            raise DataError(f"the inputs {', '.join(inputs)} contain no documents")
        metadata = {
            "format_version": FORMAT_VERSION,
            "tokenizer": {"name_or_path": str(tokenizer), "fingerprint": tokenizer_fingerprint(loaded_tokenizer),
                          "vocab_size": vocab_size, "eos_token_id": eos},
            "dtype": dtype.name,
            "num_tokens": writer.num_tokens,
            "num_documents": writer.num_documents,
            "shards": shards,
            "inputs": list(inputs),
            **(recorded or {}),
        }
        (staging / METADATA_FILE_NAME).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
        os.replace(staging, output_folder)  # replaces an empty output folder too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return metadata
