"""Multiple-choice tasks read from local files, and the token rows their choices are scored on.

A task is a file or a folder of examples, in the shapes lm-eval-harness and lighteval export: jsonl (one object a
line) or parquet files with a context, the choices and the index of the right one, or a Hugging Face ``save_to_disk``
folder (its ``test`` split, else ``validation``, else its only one). A folder of files is read file by file in name
order. Columns: the context is ``context`` or ``query`` (lighteval), the choices ``choices``, the gold index
``gold``, ``gold_index`` (lighteval; a list of one index too) or ``label`` (an integer or its digits). Nothing is
downloaded. A file with another shape stops the run before it starts, in one line naming the file and the row.

Prompts follow lm-eval-harness: ``num_fewshot`` solved examples of the same task (never the question itself), drawn
by a generator seeded with ``fewshot_seed`` and the example's index, each ``context + target_delimiter + gold
choice``, joined by ``fewshot_delimiter``, then the question's context. A choice is scored as the continuation
``target_delimiter + choice``; as lm-eval-harness's ``_encode_pair`` does, the context's trailing spaces move to the
continuation, the whole text is encoded once and the continuation is what follows the context's tokens (an empty
context is the end-of-document token). A row longer than ``sequence_length + 1`` tokens loses its first tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanotron.config import EvalTaskArgs
from nanotron.data.dataset import DataError

CONTEXT_COLUMNS, CHOICES_COLUMNS, GOLD_COLUMNS = ("context", "query"), ("choices",), ("gold", "gold_index", "label")
TABLE_SUFFIXES = (".jsonl", ".parquet")
SPLITS = ("test", "validation")  # a save_to_disk DatasetDict's split read, in this order of preference


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Row:
    """The tokens of one scored text (``tokens[:-1]`` read, ``tokens[1:]`` predicted), of which the last ``scored``
    predicted tokens count: a choice's continuation, or every token of a held-out window."""

    tokens: tuple[int, ...]
    scored: int


@dataclass(frozen=True)
class TaskRows:
    """A task's examples as rows: ``rows[starts[i]:starts[i + 1]]`` are example ``i``'s choices."""

    name: str
    examples: list[Example]
    rows: list[Row]
    starts: list[int]


def read_examples(path: Path) -> list[Example]:
    """Every example of a task file or folder, in order."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such task file or folder; point the task at a local jsonl or parquet file, or a "
                        "folder of them or written by save_to_disk")
    if path.is_dir() and _is_saved_dataset(path):
        return [_example(row, path, f"row {index}") for index, row in enumerate(_saved_dataset(path))]
    files = sorted(p for p in path.iterdir() if p.suffix in TABLE_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path} holds no .jsonl or .parquet file and is not a save_to_disk folder")
    examples = [example for file in files for example in _file_examples(file)]
    if not examples:
        raise DataError(f"{path} holds no example")
    return examples


def _is_saved_dataset(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("dataset_dict.json", "dataset_info.json", "state.json"))


def _saved_dataset(folder: Path):
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(folder))
    if isinstance(dataset, DatasetDict):
        split = next((name for name in SPLITS if name in dataset), None)
        if split is None and len(dataset) != 1:
            raise DataError(f"{folder} holds the splits {', '.join(dataset)}, none of them test or validation; "
                            "point the task at a folder of one split")
        dataset = dataset[split or next(iter(dataset))]
    return dataset


def _file_examples(file: Path) -> Iterator[Example]:
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        for index, row in enumerate(pq.read_table(file).to_pylist()):
            yield _example(row, file, f"row {index}")
        return
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise DataError(f"{file} line {number} is not a JSON object") from None
        yield _example(row, file, f"line {number}")


def _column(row: dict, names: tuple[str, ...], where: str) -> object:
    for name in names:
        if name in row:
            return row[name]
    raise DataError(f"{where} has no {' or '.join(repr(n) for n in names)} column (it has {', '.join(map(repr, row))}"
                    "); a task needs a context, its choices and the gold index")


def _example(row: object, file: Path, place: str) -> Example:
    where = f"{file} {place}"
    if not isinstance(row, dict):
        raise DataError(f"{where} is not an object with context, choices and gold")
    context, choices = _column(row, CONTEXT_COLUMNS, where), _column(row, CHOICES_COLUMNS, where)
    gold = _column(row, GOLD_COLUMNS, where)
    if not isinstance(context, str):
        raise DataError(f"{where}: the context is {type(context).__name__}, not text")
    if not isinstance(choices, (list, tuple)) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
        raise DataError(f"{where}: choices must be a list of at least two texts (got {choices!r:.80})")
    if isinstance(gold, (list, tuple)) and len(gold) == 1:
        gold = gold[0]
    if isinstance(gold, str) and gold.strip().isdigit():
        gold = int(gold)
    if not isinstance(gold, int) or isinstance(gold, bool):
        raise DataError(f"{where}: the gold index must be an integer (got {gold!r:.40})")
    if not 0 <= gold < len(choices):
        raise DataError(f"{where}: the gold index {gold} is out of range for {len(choices)} choices "
                        f"(0 to {len(choices) - 1})")
    return Example(context, tuple(choices), gold)


def fewshot_context(examples: list[Example], index: int, task: EvalTaskArgs) -> str:
    """Example ``index``'s prompt: ``task.num_fewshot`` other solved examples, then its context."""
    shots = min(task.num_fewshot, len(examples) - 1)
    drawn = random.Random(f"{task.fewshot_seed}/{index}").sample(range(len(examples) - 1), shots)
    solved = [examples[i + (i >= index)] for i in drawn]
    prefix = "".join(f"{shot.context}{task.target_delimiter}{shot.choices[shot.gold]}{task.fewshot_delimiter}"
                     for shot in solved)
    return prefix + examples[index].context


def choice_row(tokenizer, context: str, continuation: str, sequence_length: int, empty_context: int) -> Row:
    """The row scoring ``continuation`` after ``context`` (lm-eval-harness's ``_encode_pair``)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if context:
        whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
        context_ids = tokenizer.encode(context, add_special_tokens=False).ids
        context_ids, continuation_ids = whole[:len(context_ids)], whole[len(context_ids):]
    else:
        context_ids, continuation_ids = [empty_context], tokenizer.encode(continuation, add_special_tokens=False).ids
    tokens = (context_ids + continuation_ids)[-(sequence_length + 1):]
    return Row(tuple(tokens), min(len(continuation_ids), len(tokens) - 1))


def task_rows(task: EvalTaskArgs, tokenizer, sequence_length: int, empty_context: int) -> TaskRows:
    """The task's examples (the first ``max_samples``, then as many as ``max_tokens`` holds) and their rows."""
    examples = read_examples(task.path)
    kept, rows, starts, tokens = [], [], [], 0
    for index, example in enumerate(examples[:task.max_samples]):
        context = fewshot_context(examples, index, task)
        choices = [choice_row(tokenizer, context, task.target_delimiter + choice, sequence_length, empty_context)
                   for choice in example.choices]
        if any(row.scored == 0 for row in choices):
            raise DataError(f"{task.path}: example {index} has a choice that encodes to no token after its context")
        tokens += sum(len(row.tokens) - 1 for row in choices)
        if task.max_tokens is not None and tokens > task.max_tokens:
            break
        kept.append(example)
        starts.append(len(rows))
        rows += choices
    if not kept:
        raise DataError(f"{task.path}: its first example needs more than max_tokens ({task.max_tokens}) tokens; "
                        "raise max_tokens")
    return TaskRows(task.task_name, kept, rows, starts + [len(rows)])
