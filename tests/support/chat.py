"""Supervised fine-tuning's data: a chat tokenizer saved by ``transformers`` (the tiny tokenizer with ChatML's special
tokens and template), a small chat set with a rule to learn, and the SFT configs of the tiny Llama."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from support.configs import tiny_config_dict
from support.corpus import WORDS

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
# The same text, with transformers' generation tags around what the assistant writes: its own assistant masks.
CHATML_WITH_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_VOCAB = 392  # the tiny tokenizer's 384 ids and the two ChatML tokens, padded
ADJECTIVES, NOUNS, VERBS = WORDS[4:10], WORDS[13:21], WORDS[23:26]


def save_chat_tokenizer(tokenizer_file: Path, folder: Path, template: str = CHATML) -> Path:
    """The tiny tokenizer with ``<|im_start|>`` and ``<|im_end|>`` and ``template``, saved by ``transformers``."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|im_end|>",
                                                     additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


# Questions no conversation of the chat set asks: a held-out task, whose answers follow the same rule.
HELD_OUT = [(adjective, noun) for index, (adjective, noun) in enumerate(itertools.product(ADJECTIVES, NOUNS))
            if index % 3 == 0]


def verb(noun: str) -> str:
    """What the noun does: the rule the model learns."""
    return VERBS[NOUNS.index(noun) % len(VERBS)]


def exchange(adjective: str, noun: str, verb_: str) -> list[dict[str, str]]:
    """A question about the adjective and noun, and the answer that the noun does ``verb_``."""
    return [{"role": "user", "content": f"the {adjective} {noun}"},
            {"role": "assistant", "content": f"the {adjective} {noun} {verb_}."}]


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """A conversation of one or two questions none of ``HELD_OUT``, with a system message now and then."""
    messages = [{"role": "system", "content": "the dog sees the cat."}] if rng.random() < 0.3 else []
    for _ in range(1 if rng.random() < 0.8 else 2):
        adjective, noun = rng.choice([pair for pair in itertools.product(ADJECTIVES, NOUNS) if pair not in HELD_OUT])
        messages += exchange(adjective, noun, verb(noun))
    return messages


def write_chat_set(path: Path, conversations: int = 64, seed: int = 0) -> Path:
    """A ``.jsonl`` file of ``conversations`` conversations under ``messages``."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": conversation(rng)}) + "\n" for _ in range(conversations)))
    return path


def sft_config(tiny_data: dict, chat: dict, run: Path, *, steps: int = 10, pack: bool = True, dp: int = 1, tp: int = 1,
               pp: int = 1, micro_batch_size: int = 2, accumulation: int = 2, **dataset) -> dict:
    """The tiny Llama fine-tuned on ``chat`` (``{"tokenizer": folder, "data": jsonl}``), 128-token samples."""
    config = tiny_config_dict(
        tiny_data, run, parallelism={"dp": dp, "tp": tp, "pp": pp},
        tokenizer={"tokenizer_name_or_path": str(chat["tokenizer"])},
        tokens={"sequence_length": 128, "train_steps": steps, "micro_batch_size": micro_batch_size,
                "batch_accumulation_per_replica": accumulation},
        data_stages=[{"name": "sft", "start_training_step": 1, "data": {
            "seed": 5, "num_loading_workers": 0,
            "dataset": {"hf_dataset_or_datasets": str(chat["data"]), "pack": pack, **dataset}}}])
    config["model"]["model_config"] |= {"vocab_size": CHAT_VOCAB, "max_position_embeddings": 128}
    config["optimizer"]["learning_rate_scheduler"] |= {"lr_warmup_steps": 1}
    return config
