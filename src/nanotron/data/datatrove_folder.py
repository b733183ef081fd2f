"""Folders tokenized by datatrove (upstream nanotron's Nanoset data), read directly with numpy.

datatrove's ``DocumentTokenizer`` (and ``DocumentTokenizerMerger``) write, for every output file::

    <name>.ds           the token ids, raw little-endian uint16 (token size 2) or uint32 (token size 4), documents
                        back to back, each followed by the end-of-document id when the tokenizer adds one
    <name>.ds.index     optional: uint64 little-endian, the cumulative end (in tokens) of every document, where
                        document masking cuts the samples (``DatatroveDataset``'s ``document_ends``)
    <name>.ds.metadata  optional: a text file, "<tokenizer name>|<token size>", the token count, the count in words
    <name>.ds.loss      optional: a loss mask, one byte per token (not read)

A folder is the ``*.ds`` files directly inside it (not in subfolders, as upstream's Nanoset), in name order. The token
size is the one their metadata records; without metadata, ``token_size`` (upstream's ``token_size_in_bytes``), else
the size datatrove would have chosen for ``vocab_size`` (4 bytes above 65536 ids, else 2).

Samples follow upstream's Nanoset, so that a run moved from upstream nanotron trains on the same windows (in another
order): every file is cut on its own into windows of ``sequence_length + 1`` tokens with stride
``sequence_length + 1``, so neighbouring windows share no token and the tail of each file shorter than a window is
never read. (A preprocessed folder's windows share one token: ``dataset.PretrainDataset``.) Their order, blending and
resumption are ``dataset.BlendedDataset``'s: sample ``g`` is a pure function of the step, the seed, the weights and
the folders, at any layout.
"""

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nanotron.data.dataset import (
    BlendedDataset,
    ConcatenatedArrays,
    DataError,
    check_sequence_length,
    check_token_ids,
    domain_name,
    folder_list,
)
from nanotron.data.preprocess import METADATA_FILE_NAME
from nanotron.data.tokenizer import TokenizerIdentity

__all__ = ["DatatroveDataset", "DatatroveTokens", "token_size_for"]

_TOKEN_SIZES = (2, 4)
_UNKNOWN_TOKENIZER = "Unknown Tokenizer"  # what datatrove records when it was given no tokenizer name


def token_size_for(vocab_size: int) -> int:
    """The token size, in bytes, that datatrove chooses for a vocabulary of ``vocab_size`` ids."""
    return 4 if vocab_size > np.iinfo(np.uint16).max + 1 else 2


class DatatroveTokens(ConcatenatedArrays):
    """One datatrove-tokenized folder, memory-mapped read-only, as a token stream whose segments are its files.

    Every id is checked against ``vocab_size`` when the folder is opened (datatrove records no id range, so the files
    are read, a few GB/s from the page cache, unless the token size cannot hold an id outside the vocabulary), and the
    files are checked against their index and metadata: a folder that cannot be trained on is named before training
    starts. ``id_share`` (part, parts) is the share of every file's ids this process reads: the ranks of a run split
    the reading (the trainer passes its rank and world size and raises on every rank what any of them found), so a
    run reads its dataset once, not once per rank; None skips the check for a folder already checked by this run (the
    copy a worker opens).
    """

    def __init__(self, folder: str | Path, vocab_size: int, token_size: int | None = None,
                 id_share: tuple[int, int] | None = (0, 1)):
        self.folder = Path(folder)
        self.name = domain_name(self.folder)
        self.vocab_size = vocab_size
        if not self.folder.is_dir():
            raise DataError(f"dataset folder {self.folder} does not exist; check dataset_folder")
        files = sorted(self.folder.glob("*.ds"))
        if not files:
            raise DataError(not_a_token_folder(self.folder))
        for file in files:
            _check_is_a_file(file)
        recorded = {file: _read_file_metadata(file) for file in files}
        self.tokenizer_name = self._one_value("tokenizers", {file: name for file, (name, _, _) in recorded.items()})
        recorded_size = self._one_value("token sizes", {file: size for file, (_, size, _) in recorded.items()})
        if token_size is not None and recorded_size is not None and token_size != recorded_size:
            raise DataError(f"token_size_in_bytes is {token_size} but the files of {self.folder} hold "
                            f"{recorded_size}-byte tokens (their .ds.metadata); set token_size_in_bytes: "
                            f"{recorded_size} or leave it out")
        self.token_size = recorded_size or token_size or token_size_for(vocab_size)
        if self.token_size not in _TOKEN_SIZES:
            raise DataError(f"token_size_in_bytes must be 2 or 4, got {self.token_size}")
        dtype = np.dtype(f"<u{self.token_size}")
        arrays, self._document_ends = zip(*(self._open(file, dtype, recorded[file][2]) for file in files))
        self.files_without_index = [file for file, ends in zip(files, self._document_ends) if ends is None]
        if id_share is not None and np.iinfo(dtype).max >= vocab_size:
            part, parts = id_share
            for file, tokens in zip(files, arrays):
                start, end = len(tokens) * part // parts, len(tokens) * (part + 1) // parts
                check_token_ids(file, tokens[start:end], vocab_size, self._id_remedy(), kind="file", first=start,
                                vocabulary=f"the {vocab_size} ids of the model's vocabulary")
        self._concatenate(arrays, files, "file", self._id_remedy())
        self.segment_lengths = tuple(len(tokens) for tokens in arrays)  # windows never cross a file's end

    def _one_value(self, what: str, values: dict[Path, object]) -> object | None:
        """The value all files that record one agree on (None if none records it); a folder mixing them is refused."""
        distinct = {value for value in values.values() if value is not None}
        if len(distinct) > 1:
            listed = ", ".join(f"{file.name}: {value}" for file, value in values.items() if value is not None)
            raise DataError(f"the files of {self.folder} were written with different {what} ({listed}); a folder "
                            f"must hold one tokenization, put the others in their own folder")
        return distinct.pop() if distinct else None

    def _open(self, file: Path, dtype: np.dtype, recorded_tokens: int | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The tokens of ``file`` and the document ends its ``.ds.index`` records (None without one)."""
        size = file.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"{file} holds {size} bytes, not a whole number of {dtype.itemsize}-byte tokens: it is "
                            f"truncated or its token size is not {dtype.itemsize}; re-tokenize it")
        num_tokens = size // dtype.itemsize
        if recorded_tokens is not None and recorded_tokens != num_tokens:
            raise DataError(f"{file}.metadata records {recorded_tokens} tokens but {file.name} holds {num_tokens}: "
                            f"the files do not belong together; re-tokenize the folder")
        return _memory_map(file, dtype, num_tokens), _open_index(file, num_tokens, dtype.itemsize)

    def document_ends(self, start: int, length: int) -> np.ndarray:
        """Which of the tokens ``[start, start + length)`` end a document, as the files' ``.ds.index`` record them
        (every file must have one: ``files_without_index`` is empty)."""
        out = np.zeros(length, dtype=bool)
        stop = start + length
        file = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        while file < len(self._document_ends) and self._shard_starts[file] < stop:
            offset, ends = int(self._shard_starts[file]), self._document_ends[file]
            bounds = np.array([max(start - offset, 0), stop - offset], dtype=np.uint64)
            first, last = np.searchsorted(ends, bounds, side="right")  # the ends e with start < e + offset <= stop
            out[ends[first:last].astype(np.int64) + (offset - 1 - start)] = True
            file += 1
        return out

    def _id_remedy(self) -> str:
        written_by = (f"tokenized with {self.tokenizer_name}, whose" if self.tokenizer_name else
                      "tokenized (its .ds.metadata names no tokenizer) with a tokenizer whose")
        return (f"the folder was {written_by} ids go beyond the model's vocabulary; train on data tokenized with the "
                f"model's tokenizer, or set vocab_size to that tokenizer's vocabulary")

    def __reduce__(self):
        # Reopen the memory maps in the receiving process (data-loading workers); their ids were checked here.
        return DatatroveTokens, (self.folder, self.vocab_size, self.token_size, None)


def _read_file_metadata(file: Path) -> tuple[str | None, int | None, int | None]:
    """Tokenizer name, token size and token count that ``<file>.metadata`` records (None for what is absent)."""
    path = file.with_name(file.name + ".metadata")
    if not path.is_file():
        return None, None, None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    try:
        name, size = lines[0].rsplit("|", 1)
        count = int(lines[1]) if len(lines) > 1 else None
        size = int(size)
    except (IndexError, ValueError):
        raise DataError(f"{path} is not datatrove metadata (expected \"<tokenizer>|<token size>\" then the token "
                        f"count); re-tokenize the folder or delete the .metadata files") from None
    if size not in _TOKEN_SIZES:
        raise DataError(f"{path} records a token size of {size} bytes; datatrove writes 2 or 4")
    return (None if name == _UNKNOWN_TOKENIZER else name), size, count


def _memory_map(file: Path, dtype: np.dtype, length: int) -> np.ndarray:
    if length == 0:  # an empty file cannot be memory-mapped
        return np.empty(0, dtype=dtype)
    return np.memmap(file, dtype=dtype, mode="r", shape=(length,))


def _open_index(file: Path, num_tokens: int, token_size: int) -> np.ndarray | None:
    """The document ends that ``<file>.index`` records (None without one); refused if the last of them is not the
    end of ``file`` (they were not written together). Samples are cut without it; document masking reads it."""
    index = file.with_name(file.name + ".index")
    if not index.is_file():
        return None
    size = index.stat().st_size
    if size % 8:
        raise DataError(f"{index} holds {size} bytes, not a whole number of uint64 document ends; re-tokenize it")
    ends = _memory_map(index, np.dtype("<u8"), size // 8)
    last_end = int(ends[-1]) if len(ends) else 0
    if last_end != num_tokens:
        raise DataError(f"{index} ends its last document at token {last_end} but {file.name} holds {num_tokens} "
                        f"tokens of {token_size} bytes: the token size is wrong or the files do not belong together; "
                        f"check token_size_in_bytes or re-tokenize the folder")
    return ends


def _check_is_a_file(file: Path) -> None:
    """Refuse a ``*.ds`` entry that cannot be read as a token file: a dangling symbolic link, a directory."""
    if file.is_symlink() and not file.exists():
        raise DataError(f"{file} is a symbolic link to {os.readlink(file)}, which does not exist; restore the file "
                        f"it points to, or remove the link")
    if not file.is_file():
        raise DataError(f"{file} is not a file but datatrove folders hold their tokens in *.ds files; move it out of "
                        f"{file.parent}")


def briefly(paths: Sequence[Path], shown: int = 3) -> str:
    """The first ``shown`` of ``paths`` and how many more there are, for a message."""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(str(path) for path in paths[:shown]) + more


def not_a_token_folder(folder: Path) -> str:
    """Why ``folder`` (a directory) holds no tokens to train on: neither ``nanotron preprocess``'s metadata.json nor
    datatrove's ``*.ds`` files; names the subfolders that hold ``*.ds`` files, which are not searched."""
    nested = sorted({file.parent for file in folder.rglob("*.ds")})
    if nested:
        return (f"{folder} holds no .ds files itself, only in its subfolders ({briefly(nested)}); datatrove folders "
                f"are read without their subfolders, as upstream's Nanoset reads them: list those folders in "
                f"dataset_folder")
    return (f"{folder} holds neither {METADATA_FILE_NAME} (a folder of nanotron preprocess) nor .ds files (a folder "
            f"of datatrove's DocumentTokenizer); point dataset_folder at one of them")


class DatatroveDataset(BlendedDataset):
    """The sample stream of datatrove-tokenized folders (upstream's Nanoset): windows of ``sequence_length + 1``
    tokens, stride ``sequence_length + 1``, cut per file; blended by ``weights`` (default: the token counts).

    ``vocab_size`` is the model's vocabulary, which every id is checked against (datatrove records only the
    tokenizer's name; ``id_share``: this process's share of the reading, ``DatatroveTokens``); ``token_size`` is
    upstream's ``token_size_in_bytes``, needed only for files without metadata.

    The folders must be tokenized by one tokenizer. Datatrove records it by name: ``tokenizer_fingerprints`` are those
    of the files the names lead to on this machine (``TokenizerIdentity.find``; None where there are none), so that
    folders, the model's tokenizer and a checkpoint's are compared by content. With ``document_ends`` (document
    masking) the samples carry the document ends the ``.ds.index`` files record, when every file has one
    (``records_document_ends``; else ``files_without_index`` names those that have none). Datatrove records no
    end-of-document id: ``eos_token_id`` is the tokenizer's, where it is known.
    """

    def __init__(self, folders: str | Path | Sequence[str | Path], weights: Sequence[float] | None,
                 sequence_length: int, seed: int, vocab_size: int, token_size: int | None = None,
                 id_share: tuple[int, int] = (0, 1), document_ends: bool = False, eos_token_id: int | None = None):
        folders = folder_list(folders)
        check_sequence_length(sequence_length)
        streams = [DatatroveTokens(folder, vocab_size, token_size, id_share) for folder in folders]
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer_names = [stream.tokenizer_name for stream in streams]
        found = {name: TokenizerIdentity.find(name) for name in set(self.tokenizer_names) if name is not None}
        self.tokenizer_fingerprints = [found[name].fingerprint if name else None for name in self.tokenizer_names]
        _check_one_tokenizer(streams, found)
        self.files_without_index = [file for stream in streams for file in stream.files_without_index]
        self.records_document_ends = document_ends and not self.files_without_index
        super().__init__(streams, weights, sequence_length, seed, window_stride=sequence_length + 1)


def _check_one_tokenizer(streams: Sequence[DatatroveTokens], found: dict[str, TokenizerIdentity]) -> None:
    """Refuse folders tokenized by different tokenizers: by content where their files are on this machine, else by
    name (``TokenizerIdentity.same_as``)."""
    named = [stream for stream in streams if stream.tokenizer_name is not None]
    if all(found[stream.tokenizer_name].same_as(found[named[0].tokenizer_name]) for stream in named[1:]):
        return
    raise DataError("the folders of dataset_folder were tokenized with different tokenizers ("
                    + ", ".join(f"{stream.folder}: {stream.tokenizer_name}" for stream in named)
                    + "); tokenize them all with the same tokenizer")
