"""Pre-tokenized Hugging Face datasets: rows of token ids in an ``input_ids`` column, read as they are.

Upstream's DoReMi example tokenizes its domains itself and saves each one with ``save_to_disk``: rows of
``sequence_length + 1`` ids (beside a ``domain_ids`` column), each row one training sample. Rules:

- A dataset is pre-tokenized when it has an ``input_ids`` column of integer lists (any integer type, fixed or
  variable length) and no column of the stage's ``text_column_name``; it is read without a tokenizer.
- Rows that all hold the same number of ids are **windows**: each row is a segment that no sample crosses, so a row
  of ``sequence_length + 1`` ids is exactly one sample, as upstream reads it (a longer row gives the windows that fit
  in it, neighbours sharing one token). Rows shorter than ``sequence_length + 1`` cannot make a sample: refused.
- Rows of different lengths are **documents**: they follow each other as one stream, cut into windows as a tokenized
  text dataset is (neighbours sharing one token), their ids as written (no end-of-document id is added).
- The ids are read in place from the dataset's Arrow files (memory-mapped), never copied into a cache. They are
  checked once when opened: none may be negative, and the largest must fit the model's vocabulary (the source's
  ``vocab_size`` is the largest id + 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nanotron.data.dataset import ConcatenatedArrays, DataError

__all__ = ["INPUT_IDS", "ArrowTokens", "is_pretokenized"]

INPUT_IDS = "input_ids"
_REMEDY = "the dataset changed after it was opened; restart the run"


def is_pretokenized(parts: Sequence, text_column: str) -> bool:
    """Whether the splits ``parts`` (``datasets.Dataset``) hold token ids to read as they are: an ``input_ids``
    column and no ``text_column``."""
    return all(INPUT_IDS in part.column_names and text_column not in part.column_names for part in parts)


class ArrowTokens(ConcatenatedArrays):
    """The ``input_ids`` of a pre-tokenized dataset's splits ``parts``, seen as one token stream: rows of one length
    are windows (segments of their own), rows of several lengths documents (one segment)."""

    vocab_size: int
    eos_token_id = None  # the rows are read as written: no end-of-document id is known
    tokenizer_fingerprint = tokenizer_name = None  # nothing records the tokenizer that wrote them

    def __init__(self, dataset: str | Path, parts: Sequence, sequence_length: int):
        self.folder, self.name, self._parts = Path(str(dataset)), Path(str(dataset).rstrip("/")).name, list(parts)
        self._sequence_length = sequence_length
        columns = [_integer_lists(dataset, part) for part in self._parts]
        chunks = [chunk for column in columns for chunk in column.chunks if len(chunk)]
        if not chunks:
            raise DataError(f"the Hugging Face dataset {dataset} has no rows of {INPUT_IDS}; give a dataset with rows")
        lengths = np.concatenate([_row_lengths(chunk) for chunk in chunks])
        arrays = [_values(chunk) for chunk in chunks]
        ranges = [(int(array.min()), int(array.max())) if len(array) else (0, 0) for array in arrays]
        lowest, highest = min(low for low, _ in ranges), max(high for _, high in ranges)
        if lowest < 0:
            raise DataError(f"the Hugging Face dataset {dataset} holds token id {lowest} in {INPUT_IDS}; token ids "
                            "are never negative: tokenize it again")
        self.vocab_size = highest + 1
        self._concatenate(arrays, [self.folder] * len(arrays), "dataset", _REMEDY, ranges)
        if lengths.min() == lengths.max():  # windows: every row a segment of its own
            if lengths[0] < sequence_length + 1:
                raise DataError(
                    f"the Hugging Face dataset {dataset} holds rows of {lengths[0]} token ids ({INPUT_IDS}), each one "
                    f"sample, shorter than tokens.sequence_length + 1 ({sequence_length + 1}); set "
                    f"tokens.sequence_length to {lengths[0] - 1} or lower, or tokenize the dataset again at rows of "
                    f"{sequence_length + 1}")
            self.segment_lengths = lengths
        else:  # documents: one stream
            self.segment_lengths = (self.num_tokens,)

    def __reduce__(self):
        # datasets pickles memory-mapped tables by their files: a loading worker maps them again, copying nothing
        return type(self), (self.folder, self._parts, self._sequence_length)


def _integer_lists(dataset: str | Path, part):
    """The ``input_ids`` column of a split (an Arrow ChunkedArray), refused unless it holds lists of integers."""
    import pyarrow

    column = part.data.column(INPUT_IDS)
    kind = column.type
    if not (pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind)
            or pyarrow.types.is_fixed_size_list(kind)) or not pyarrow.types.is_integer(kind.value_type):
        raise DataError(f"column {INPUT_IDS!r} of the Hugging Face dataset {dataset} holds {kind}, not lists of "
                        "token ids; give the token ids of each row as a list of integers, or a text column "
                        "(text_column_name) to tokenize")
    if column.null_count:
        raise DataError(f"{column.null_count} rows of the Hugging Face dataset {dataset} have no {INPUT_IDS} (null); "
                        "give every row its token ids")
    return column


def _row_lengths(chunk) -> np.ndarray:
    import pyarrow.compute

    return pyarrow.compute.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)


def _values(chunk) -> np.ndarray:
    """The ids of a chunk's rows, one after the other: a view of the Arrow buffer where the type allows."""
    return chunk.flatten().to_numpy(zero_copy_only=False)
