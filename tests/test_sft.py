"""Supervised fine-tuning: conversations rendered with the tokenizer's chat template as transformers renders them,
the tokens trained on checked token by token against transformers' own assistant masks, packing (a packed batch
trains as its conversations one by one), the layouts against one process, an exact resume, bad conversations refused
in one line, and the Hugging Face round trip with the chat template."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from support.chat import (
    CHAT_VOCAB,
    CHATML,
    CHATML_WITH_GENERATION,
    HELD_OUT,
    VERBS,
    conversation,
    exchange,
    save_chat_tokenizer,
    sft_config,
    verb,
    write_chat_set,
)
from support.configs import write_config
from support.hf import LLAMA_SHAPE
from support.parity import first_step_gradients
from support.runs import assert_user_error, cli, metrics, train_in_process, train_on_ranks, train_through_cli

STEPS = 10


@pytest.fixture(scope="module")
def chat(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """The chat tokenizer saved by transformers (ChatML in chat_template.jinja) and a chat set of 96
    conversations."""
    root = tmp_path_factory.mktemp("chat")
    return {"tokenizer": save_chat_tokenizer(tiny_data["tokenizer"], root / "tokenizer"),
            "data": write_chat_set(root / "chat.jsonl", conversations=96)}


@pytest.fixture(scope="module")
def reference(tiny_data, chat, tmp_path_factory) -> dict:
    """The SFT run on one process, saved at step 5 and at the end."""
    run = tmp_path_factory.mktemp("sft_reference") / "run"
    config = sft_config(tiny_data, chat, run, steps=STEPS)
    config["checkpoints"]["checkpoint_interval"] = 5
    return {"run": run, "config": config, "metrics": train_in_process(config)}


def _transformers_tokenizer(folder: Path):
    return pytest.importorskip("transformers").AutoTokenizer.from_pretrained(folder)


def _tokenized(folder: Path, messages: list[dict], train_on: str, template: str | None = None):
    from nanotron.data.chat import load_chat_template, tokenized_conversation
    from nanotron.data.tokenizer import load_tokenizer

    return tokenized_conversation(load_tokenizer(folder), load_chat_template(folder, template), messages, train_on)


@pytest.mark.slow
@pytest.mark.parametrize("saved_in", ["chat_template.jinja", "tokenizer_config.json", "generation blocks"])
def test_trained_tokens_are_transformers_assistant_tokens(chat, tmp_path, saved_in):
    folder = chat["tokenizer"]
    if saved_in == "tokenizer_config.json":  # as transformers before 4.50 saved it
        folder = Path(shutil.copytree(folder, tmp_path / "tokenizer"))
        (folder / "chat_template.jinja").unlink()
        settings = json.loads((folder / saved_in).read_text())
        (folder / saved_in).write_text(json.dumps(settings | {"chat_template": CHATML}))
    if saved_in == "generation blocks":  # as SmolLM3's template marks what the assistant writes
        folder = Path(shutil.copytree(folder, tmp_path / "tokenizer"))
        (folder / "chat_template.jinja").write_text(CHATML_WITH_GENERATION)
    hf = _transformers_tokenizer(chat["tokenizer"])
    rng = random.Random(1)
    for _ in range(8):
        messages = conversation(rng)
        # transformers' own assistant masks: the same text, its assistant parts in generation tags
        tagged = hf.apply_chat_template(messages, chat_template=CHATML_WITH_GENERATION, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
        assert hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"] == tagged["input_ids"]
        expected = np.array(tagged["assistant_masks"], dtype=bool)
        ids, trained = _tokenized(folder, messages, "assistant")
        assert ids.tolist() == tagged["input_ids"]
        assert trained.tolist() == expected.tolist()
        answers = "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert hf.decode(ids[trained].tolist()) == answers
        last = np.zeros_like(expected)
        last_start = len(expected) - int(np.argmax(~expected[::-1] & (np.cumsum(expected[::-1]) > 0)))
        last[last_start:] = expected[last_start:]
        assert _tokenized(folder, messages, "last_assistant")[1].tolist() == last.tolist()
        assert _tokenized(folder, messages, "all")[1].all()


@pytest.mark.slow
def test_a_built_in_template_renders_as_the_same_template_in_transformers(chat):
    hf = _transformers_tokenizer(chat["tokenizer"])
    messages = conversation(random.Random(2))
    ids, _ = _tokenized(chat["tokenizer"], messages, "assistant", template="chatml")
    assert ids.tolist() == hf.apply_chat_template(messages, chat_template=CHATML, return_dict=True)["input_ids"]


@pytest.mark.slow
def test_rendering_without_jinja2_is_one_error_naming_the_extra(chat, monkeypatch):
    from nanotron.data import chat as chat_module
    from nanotron.data.chat import TemplateError, load_chat_template

    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setattr(chat_module, "_TEMPLATES", {})
    with pytest.raises(TemplateError, match=r'needs jinja2: pip install -e "\.\[sft\]"'):
        load_chat_template(chat["tokenizer"], "chatml").render(conversation(random.Random(0)))


def test_packing_keeps_conversations_whole_and_in_order():
    from nanotron.data.sft import pack

    assert pack(np.array([3, 4, 2, 9, 1]), 9).tolist() == [0, 3, 4, 5]
    assert pack(np.array([3, 4, 2]), 9, packing=False).tolist() == [0, 1, 2, 3]


def _chat_dataset(chat: dict, sequence_length: int, pack: bool = True, conversations: int | None = None):
    from nanotron.data.chat import load_chat_template
    from nanotron.data.sft import ChatDataset, ChatSettings
    from nanotron.data.tokenizer import load_tokenizer

    folder = chat["tokenizer"]
    settings = ChatSettings(load_chat_template(folder), max_conversations=conversations, pack=pack)
    return ChatDataset(chat["data"], load_tokenizer(folder), str(folder), sequence_length, 5, settings)


@pytest.mark.slow
def test_every_conversation_is_one_document_once_per_epoch_and_overlong_ones_are_cut(chat):
    from nanotron.data.loader import _to_micro_batch

    dataset = _chat_dataset(chat, 64)  # two-turn conversations with a system message are longer: cut
    count = dataset.num_windows[0]
    samples = dataset.samples(range(count))
    ends, trained, padding = samples["document_ends"], samples["trained"], samples["tokens"] == dataset.eos_token_id
    assert int((ends & ~padding).sum()) == 96  # every conversation ends once in the epoch, the cut ones too
    assert (ends[padding]).all() and not trained[padding].any()  # padding: a document per token, never trained on
    assert count < 96 and int((ends & ~padding)[:, -1].sum()) > 0  # packed, and conversations cut to a sample
    batch = _to_micro_batch(samples, None)
    assert torch.equal(batch.label_mask, trained[:, 1:] & ~ends[:, :-1])
    assert (batch.position_ids[:, 0] == 0).all()
    # the next epoch holds the same samples in another order
    again = dataset.samples(range(count, 2 * count))["tokens"]
    assert sorted(map(tuple, again.tolist())) == sorted(map(tuple, samples["tokens"].tolist()))
    assert not torch.equal(again, samples["tokens"])


@pytest.mark.slow
def test_a_saved_hugging_face_dataset_gives_the_samples_of_its_jsonl(chat, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in chat["data"].read_text().splitlines()]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "saved")
    from_jsonl = _chat_dataset(chat, 128)
    from_saved = _chat_dataset(chat | {"data": tmp_path / "saved"}, 128)
    for key, tensor in from_jsonl.samples(range(40)).items():
        assert torch.equal(from_saved.samples(range(40))[key], tensor), key
    rows[3]["messages"][-1]["role"] = "bot"
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "bad")
    from nanotron.data.documents import DataError

    with pytest.raises(DataError, match=rf"the Hugging Face dataset {tmp_path / 'bad'}, split train, row 3: .*'bot'"):
        _chat_dataset(chat | {"data": tmp_path / "bad"}, 128)


def test_conversations_need_a_tokenizer_and_a_model_with_attention(tiny_data, tmp_path):
    from nanotron.config import ConfigError, config_from_dict
    from support.configs import MAMBA

    config = sft_config(tiny_data, {"tokenizer": tmp_path, "data": tmp_path / "chat.jsonl"}, tmp_path / "run")
    config["tokenizer"] = {"tokenizer_name_or_path": None}
    config["model"]["model_config"] = MAMBA
    with pytest.raises(ConfigError) as refused:
        config_from_dict(config)
    assert "set tokenizer.tokenizer_name_or_path" in str(refused.value)
    assert "has no attention layers" in str(refused.value)


def _first_step(config: dict) -> tuple[float, dict]:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    loss, pieces = first_step_gradients(Trainer(config_from_dict(config)))
    return loss.item(), {name: boxes[0][1] for name, (_, boxes) in pieces.items()}


@pytest.mark.slow
def test_a_packed_batch_trains_as_its_conversations_one_by_one(tiny_data, chat, tmp_path):
    """The first 16 conversations in one global batch: packed into a few samples, then one per sample; the loss and
    the gradients agree to 1e-6 (fp32): documents see only themselves, from position 0."""
    packed = _chat_dataset(chat, 128, conversations=16).num_windows[0]
    assert packed < 8  # several conversations per sample
    results = []
    for pack, samples in ((True, packed), (False, 16)):
        config = sft_config(tiny_data, chat, tmp_path / str(pack), steps=1, pack=pack, micro_batch_size=samples,
                            accumulation=1, debug_max_samples=16)
        results.append(_first_step(config))
    (packed_loss, packed_grads), (loss, grads) = results
    assert abs(packed_loss - loss) <= 1e-6
    for name, gradient in grads.items():
        torch.testing.assert_close(packed_grads[name], gradient, atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_sft_resumes_exactly(tiny_data, chat, reference, tmp_path):
    config = dict(reference["config"], checkpoints=reference["config"]["checkpoints"] | {
        "checkpoints_path": str(tmp_path / "resumed"), "resume_checkpoint_path": str(reference["run"] / "5")})
    resumed = train_in_process(config)
    assert [m["step"] for m in resumed] == list(range(6, STEPS + 1))
    assert [m["lm_loss"] for m in resumed] == [m["lm_loss"] for m in reference["metrics"][5:]]
    first, last = reference["metrics"][0]["lm_loss"], reference["metrics"][-1]["lm_loss"]
    assert last < first - 1.0, (first, last)  # the reference learns the answers


LAYOUTS = [pytest.param({"dp": 2}, id="dp2"),
           pytest.param({"tp": 2}, id="tp2", marks=pytest.mark.full_tier),
           pytest.param({"pp": 2}, id="pp2", marks=pytest.mark.full_tier)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sft_layouts_train_as_one_process(tiny_data, chat, reference, tmp_path, layout):
    accumulation = 2 // layout.get("dp", 1)
    config = sft_config(tiny_data, chat, tmp_path / "run", steps=STEPS, accumulation=accumulation, **layout)
    losses = [m["lm_loss"] for m in train_on_ranks(config, 2)]
    expected = [m["lm_loss"] for m in reference["metrics"]]
    np.testing.assert_allclose(losses, expected, rtol=2e-5, atol=0)


def _bad_set(tmp_path: Path, messages) -> Path:
    lines = [{"messages": conversation(random.Random(0))}, {"messages": messages}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("messages, fragment", [
    ([{"content": "hi"}, {"role": "assistant", "content": "the dog."}], "message 0 has no role"),
    ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}], "unknown role 'robot'"),
    ([{"role": "user", "content": "the cat"}], "has no assistant message"),
], ids=["missing-role", "unknown-role", "no-assistant"])
def test_a_bad_conversation_is_one_line_naming_the_file_and_line(tiny_data, chat, tmp_path, messages, fragment):
    config = sft_config(tiny_data, chat | {"data": _bad_set(tmp_path, messages)}, tmp_path / "run")
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, f"{tmp_path / 'bad.jsonl'}, line 2: ", fragment)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # the run did not start


@pytest.mark.slow
def test_a_template_that_does_not_render_is_one_line(tiny_data, chat, tmp_path):
    folder = Path(shutil.copytree(chat["tokenizer"], tmp_path / "tokenizer"))
    (folder / "chat_template.jinja").write_text("{{ raise_exception('only one turn') }}")
    config = sft_config(tiny_data, {"tokenizer": folder, "data": chat["data"]}, tmp_path / "run")
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, f"{chat['data']}, line 1: ", "refuses the conversation: only one turn")


def _hf_llama(folder: Path, tokenizer: Path) -> Path:
    """A tiny Llama of the chat vocabulary saved by transformers, with the chat tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = LLAMA_SHAPE | {"vocab_size": CHAT_VOCAB, "bos_token_id": None, "eos_token_id": None}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(folder)
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


@pytest.mark.slow
def test_fine_tuning_a_hugging_face_model_exports_it_with_the_chat_template(tiny_data, chat, tmp_path):
    """hf -> nanotron -> SFT (built-in ChatML, a tokenizer without a template) -> hf: the export's
    tokenizer_config.json holds the template it was trained with, which transformers then renders with."""
    tokenizer = Path(shutil.copytree(chat["tokenizer"], tmp_path / "tokenizer"))
    (tokenizer / "chat_template.jinja").unlink()
    hf = _hf_llama(tmp_path / "hf", tokenizer)
    assert cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", tmp_path / "ckpt").code == 0
    config = sft_config(tiny_data, {"tokenizer": tmp_path / "ckpt" / "tokenizer", "data": chat["data"]},
                        tmp_path / "run", steps=2, chat_template="chatml")
    config["model"]["init_method"] = {"path": str(tmp_path / "ckpt")}
    config["model"]["model_config"] |= {k: LLAMA_SHAPE[k] for k in ("intermediate_size", "max_position_embeddings")}
    config["model"]["model_config"]["tie_word_embeddings"] = False
    train_through_cli(config, tmp_path / "config.yaml")
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2]
    assert cli("convert", "nanotron-to-hf", "--ckpt-path", tmp_path / "run", "--save-path", tmp_path / "out").code == 0
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    messages = conversation(random.Random(3))
    exported = _transformers_tokenizer(tmp_path / "out").apply_chat_template(messages, return_dict=True)["input_ids"]
    assert exported == _tokenized(tokenizer, messages, "assistant", template="chatml")[0].tolist()
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.vocab_size == CHAT_VOCAB


def _example() -> dict:
    from nanotron.config import load_config

    example = Path(__file__).resolve().parents[1] / "examples" / "config_tiny_sft.yaml"
    load_config(example)  # the strict loader: unknown or duplicate keys fail here
    return yaml.safe_load(example.read_text())


def test_the_sft_example_is_a_packed_assistant_only_stage():
    dataset = _example()["data_stages"][0]["data"]["dataset"]
    assert dataset["train_on"] == "assistant" and dataset["pack"] and dataset["chat_template"] == "chatml"


def _held_out_task(path: Path, tokenizer: Path) -> Path:
    """``HELD_OUT``'s questions as a multiple-choice task of the in-loop evals (docs/evals.md): the conversation
    rendered up to the assistant's turn, and its answer with each verb; chance is 1 / len(VERBS)."""
    from nanotron.data.chat import load_chat_template

    template = load_chat_template(tokenizer)
    with path.open("w") as file:
        for adjective, noun in HELD_OUT:
            context = template.render(exchange(adjective, noun, "")[:1], add_generation_prompt=True)
            choices = [template.render(exchange(adjective, noun, candidate))[len(context):] for candidate in VERBS]
            file.write(json.dumps({"context": context, "choices": choices, "gold": VERBS.index(verb(noun))}) + "\n")
    return path


@pytest.mark.full_tier
def test_the_sft_example_trains_as_written_and_answers_held_out_questions(chat, tmp_path):
    """The example, with an eval of questions it never trained on: after 60 steps the run's own in-loop eval scores
    them well above chance."""
    raw = _example()
    raw["checkpoints"]["checkpoints_path"] = str(tmp_path / "run")
    raw["tokenizer"]["tokenizer_name_or_path"] = str(chat["tokenizer"])
    raw["data_stages"][0]["data"]["dataset"]["hf_dataset_or_datasets"] = str(chat["data"])
    raw["tokens"]["train_steps"] = 60
    raw["logging"]["iteration_step_info_interval"] = 1
    task = _held_out_task(tmp_path / "held_out.jsonl", chat["tokenizer"])
    raw["evals"] = {"tasks": [{"path": str(task), "name": "held_out", "target_delimiter": ""}]}
    train_through_cli(raw, tmp_path / "config.yaml")
    records = metrics(tmp_path / "run")
    losses = [m["lm_loss"] for m in records]
    assert len(losses) == 60 and losses[-1] < losses[0] - 1.0, losses
    accuracy = records[-1]["eval/held_out/acc"]
    assert accuracy > 1 / len(VERBS) + 0.25, accuracy  # chance: 1/3


def test_an_sft_dataset_is_told_from_a_text_dataset_by_its_keys(tiny_data, tmp_path):
    from nanotron.config import ConfigError, HFDatasetArgs, SFTDatasetArgs, config_from_dict
    from support.configs import tiny_config_dict

    def dataset(**keys):
        stage = {"name": "sft", "start_training_step": 1, "data": {"dataset": {"hf_dataset_or_datasets": "x", **keys}}}
        return config_from_dict(tiny_config_dict(tiny_data, tmp_path, data_stages=[stage])).data_stages[0].data.dataset

    assert type(dataset()) is HFDatasetArgs and type(dataset(text_column_name="t")) is HFDatasetArgs
    assert type(dataset(sft_dataloader=True)) is SFTDatasetArgs  # upstream's marker
    assert dataset(train_on="last_assistant", hf_dataset_splits="train").hf_dataset_splits == ["train"]
    with pytest.raises(ConfigError, match=r"train_on must be one of assistant, last_assistant, all"):
        dataset(train_on="assistants")
    with pytest.raises(ConfigError, match="chat_template"):
        dataset(chat_template="vicuna")
