"""Multiple-choice task files as lm-eval-harness and lighteval users hold them, written by the real writers (jsonl,
pyarrow's parquet, datasets' ``save_to_disk``), and the ``evals`` section that reads them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from support.corpus import WORDS

ANIMALS, VERBS = WORDS[16:26], WORDS[26:34]


def task_examples(count: int = 12, seed: int = 0) -> list[dict]:
    """Questions in the tiny corpus's words: which of four endings continues "<adjectives> <animal> <verb> the"."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        context = f"{rng.choice(WORDS[:16])} {rng.choice(WORDS[:16])} {rng.choice(ANIMALS)} {rng.choice(VERBS)} the"
        choices = rng.sample(ANIMALS, 2) + ["under over", "quick and"]
        rng.shuffle(choices)
        examples.append({"context": context, "choices": choices, "gold": rng.randrange(4)})
    return examples


def write_task(path: Path, examples: list[dict], kind: str = "jsonl") -> Path:
    """``examples`` as a ``.jsonl`` or ``.parquet`` file, or (``save_to_disk``) a Hugging Face dataset folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path.write_text("".join(json.dumps(example) + "\n" for example in examples))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(examples), path)
    else:
        from datasets import Dataset, DatasetDict

        DatasetDict({"test": Dataset.from_list(examples)}).save_to_disk(str(path))
    return path


def evals_section(task: Path, held_out: Path | None = None, interval: int | None = None, **task_settings) -> dict:
    """An ``evals`` section scoring ``task`` (and the loss of ``held_out``) every ``interval`` steps."""
    section = {"eval_interval": interval, "tasks": [{"path": str(task), **task_settings}]}
    if held_out is not None:
        section |= {"held_out": [str(held_out)], "held_out_max_windows": 4}
    return section


def transformers_log_likelihoods(hf: Path, rows) -> list[float]:
    """Each row's log-likelihood (``generation/tasks.Row``) by the transformers forward of an exported model."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.tokens])
            log_probs = model(ids[:, :-1]).logits[0].double().log_softmax(-1)
            targets = ids[0, 1:]
            picked = log_probs.gather(-1, targets[:, None])[:, 0]
            scores.append(picked[len(targets) - row.scored:].sum().item())
    return scores
