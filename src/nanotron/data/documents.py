"""Reading raw input files (``.txt``, ``.jsonl``, ``.parquet``) as documents.

Both tokenizer training and preprocessing read their inputs through this module. It is its own module, below
both, so that neither needs to import the other (``preprocess`` tokenizes with ``tokenizer``; ``tokenizer`` only
needs the documents), and it imports neither torch nor a tokenizer.
"""

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
_PARQUET_ROWS_PER_READ = 1024


class DataError(ValueError):
    """Input files or a preprocessed folder are missing, malformed or inconsistent.

    It lives here, at the bottom of ``nanotron.data``, so that tokenizer training, preprocessing and its worker
    processes need not import torch; ``nanotron.data.preprocess.DataError`` and ``nanotron.data.dataset.DataError``
    are the same class.
    """


def list_input_files(inputs: Sequence[Path]) -> list[Path]:
    """Expand files and directories (recursively, sorted) into the list of supported input files."""
    if not inputs:
        raise DataError("no input given; pass at least one --input file or directory")
    suffixes = ", ".join(SUPPORTED_SUFFIXES)
    files: list[Path] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            found = sorted(file for file in path.rglob("*") if file.suffix in SUPPORTED_SUFFIXES and file.is_file())
            if not found:
                raise DataError(f"input directory {path} contains no {suffixes} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUPPORTED_SUFFIXES:
                raise DataError(f"input {path} has an unsupported format; use {suffixes} files or directories")
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist; check the --input path")
    return files


def iter_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    """Yield the documents of one input file, in file order.

    A ``.txt`` file is one document (blank lines inside it separate paragraphs, not documents); a ``.jsonl`` file
    holds one JSON object per line with the text under ``text_key``; a ``.parquet`` file has a ``text_key``
    string column.
    """
    path = Path(path)
    readers = {".txt": _iter_txt, ".jsonl": _iter_jsonl, ".parquet": _iter_parquet}
    if path.suffix not in readers:
        raise DataError(f"input {path} has an unsupported format; use {', '.join(SUPPORTED_SUFFIXES)} files")
    return readers[path.suffix](path, text_key)


def _iter_txt(path: Path, text_key: str) -> Iterator[str]:
    try:
        yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path} is not valid UTF-8 ({error.reason} at byte {error.start}); convert it to UTF-8") from None


def _iter_jsonl(path: Path, text_key: str) -> Iterator[str]:
    for text, where in iter_json_values(path, text_key, "pass the key that holds the text with --text-key"):
        if not isinstance(text, str):
            raise DataError(f"{where}: {text_key!r} holds a {type(text).__name__}, not a string")
        yield text


def iter_json_values(path: Path, key: str, fix: str) -> Iterator[tuple[object, str]]:
    """The value under ``key`` of every line of a JSON-lines file (blank lines skipped) and where it stands (the file
    and line, for messages); a line that is not a JSON object holding ``key`` is a DataError naming it (``fix``: what
    to do about a missing key)."""
    line_number = 0
    try:
        with path.open(encoding="utf-8") as file:
            for line_number, line in enumerate(file, start=1):
                if line.strip():
                    where = f"{path}, line {line_number}"
                    yield _json_value(line, key, where, fix), where
    except UnicodeDecodeError as error:
        raise DataError(f"{path}, after line {line_number}: not valid UTF-8 ({error.reason}); "
                        f"convert the file to UTF-8") from None


def _json_value(line: str, key: str, where: str, fix: str) -> object:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: invalid JSON ({error.msg}); every line must be one JSON object") from None
    if not isinstance(record, dict) or key not in record:
        raise DataError(f"{where}: no {key!r} key; {fix}")
    return record[key]


def _iter_parquet(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install nanotron[parquet]") from None
    try:
        table = parquet.ParquetFile(path)
    except (OSError, ValueError) as error:
        raise DataError(f"{path} is not a readable parquet file ({error})") from None
    columns = table.schema_arrow.names
    if text_key not in columns:
        raise DataError(f"{path} has no column {text_key!r} (columns: {', '.join(columns)}); "
                        f"pass the column that holds the text with --text-key")
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_ROWS_PER_READ, columns=[text_key]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise DataError(f"{path}, row {row}: {text_key!r} holds {text!r}, not a string")
            row += 1
            yield text
