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


LM_EVAL_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def lm_eval_scores(hf: Path, task: Path, folder: Path) -> dict:
    """lm-eval-harness's ``hf`` model on the jsonl ``task`` (a local task of its YAML format, zero-shot): acc,
    acc_norm and every example's choice log-likelihoods."""
    import transformers
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    folder.mkdir(parents=True, exist_ok=True)
    name = f"local_{task.stem}"
    (folder / f"{name}.yaml").write_text(LM_EVAL_TASK.format(name=name, path=task))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf / "tokenizer.json"),
                                                     eos_token="<|endoftext|>")
    model = HFLM(pretrained=str(hf), tokenizer=tokenizer, batch_size=4, dtype="float32", device="cpu")
    out = simple_evaluate(model=model, tasks=[name], num_fewshot=0, log_samples=True,
                          task_manager=TaskManager(include_path=str(folder)))
    samples = sorted(out["samples"][name], key=lambda sample: sample["doc_id"])
    return {"acc": out["results"][name]["acc,none"], "acc_norm": out["results"][name]["acc_norm,none"],
            "loglikelihoods": [[response[0][0] for response in sample["resps"]] for sample in samples]}
