"""Hostile inputs to the commands that read foreign files: a broken or lying Hugging Face config.json on
``nanotron convert hf-to-nanotron``, evaluation data shorter than one window, generation past the model's context.
Each gives one ``error:`` line, exit status 2, no traceback, and writes nothing.

The config.json variants damage one key of a tiny model that ``transformers`` saved (one per family: Llama, Qwen2,
Mixtral, Mamba) and run ``nanotron.cli.main`` in this process (fast); one of them, evaluation and generation run as
real ``python -m nanotron`` processes first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from support.runs import Outcome, assert_user_error, cli

transformers = pytest.importorskip("transformers")

LLAMA_SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
FAMILIES = {  # transformers class prefix and config arguments
    "llama": ("Llama", LLAMA_SHAPE),
    "qwen2": ("Qwen2", LLAMA_SHAPE | {"tie_word_embeddings": True}),
    "mixtral": ("Mixtral", LLAMA_SHAPE | {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "mamba": ("Mamba", dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, state_size=8)),
}
LLAMAS = ("llama", "qwen2", "mixtral")


Damage = Callable[[Path], None]  # changes a config.json in place


def _edit(change: Callable[[dict], None]) -> Damage:
    def damage(config_file: Path) -> None:
        config = json.loads(config_file.read_text())
        change(config)
        config_file.write_text(json.dumps(config))
    return damage


def _set(**changes) -> Damage:
    return _edit(lambda config: config.update(changes))


def _drop(key: str) -> Damage:
    return _edit(lambda config: config.pop(key))


def _flip_tied(config: dict) -> None:
    config["tie_word_embeddings"] = not config.get("tie_word_embeddings", False)


def _truncate(config_file: Path) -> None:
    text = config_file.read_text()
    config_file.write_text(text[: len(text) // 2])


# (families, name, damage, what the error line names)
VARIANTS = [
    (tuple(FAMILIES), "invalid-json", _truncate, "invalid JSON at line"),
    (tuple(FAMILIES), "not-an-object", lambda config_file: config_file.write_text("[64, 2]"), "JSON object"),
    (tuple(FAMILIES), "missing-hidden_size", _drop("hidden_size"), "'hidden_size' is missing"),
    (tuple(FAMILIES), "missing-vocab_size", _drop("vocab_size"), "'vocab_size' is missing"),
    (LLAMAS, "string-size", _set(hidden_size="64"), "hidden_size: expected an integer, got '64'"),
    (("mamba",), "string-size", _set(hidden_size="64"), "d_model: expected an integer, got '64'"),
    (tuple(FAMILIES), "float-layers", _set(num_hidden_layers=2.5), "num_hidden_layers: expected an integer"),
    (tuple(FAMILIES), "string-bool", _set(tie_word_embeddings="false"), "tie_word_embeddings: expected a boolean"),
    (tuple(FAMILIES), "zero-vocab", _set(vocab_size=0), "vocab_size must be >= 1 (got 0)"),
    (tuple(FAMILIES), "negative-layers", _set(num_hidden_layers=-2), "num_hidden_layers must be >= 1 (got -2)"),
    (LLAMAS, "zero-intermediate", _set(intermediate_size=0), "intermediate_size must be >= 1 (got 0)"),
    (tuple(FAMILIES), "huge-vocab", _set(vocab_size=10**12), "(384, 64) in the weights but (1000000000000, 64)"),
    (tuple(FAMILIES), "huge-layers", _set(num_hidden_layers=10**9), "layers.2."),
    (LLAMAS, "huge-hidden", _set(hidden_size=2**40, head_dim=None), "parameters, while the weights hold"),
    (("mamba",), "huge-hidden", _set(hidden_size=2**40, intermediate_size=2**41), "parameters, while the weights hold"),
    (tuple(FAMILIES), "vocab-disagrees", _set(vocab_size=400), "(384, 64) in the weights but (400, 64)"),
    (tuple(FAMILIES), "fewer-layers", _set(num_hidden_layers=1), "tensors that the model it describes does not have"),
    (tuple(FAMILIES), "more-layers", _set(num_hidden_layers=3), "layers.2."),
    (("llama", "mixtral"), "declared-tied", _edit(_flip_tied), "(lm_head.weight)"),
    (("qwen2", "mamba"), "declared-untied", _edit(_flip_tied), "'lm_head.weight', which the weights lack"),
    (LLAMAS, "heads-not-dividing-hidden", _set(num_attention_heads=6), "divisible by num_attention_heads (6)"),
    (LLAMAS, "kv-heads-not-dividing-heads", _set(num_key_value_heads=3), "divisible by num_key_value_heads (3)"),
    (LLAMAS, "zero-heads", _set(num_attention_heads=0), "num_attention_heads must be >= 1 (got 0)"),
    (LLAMAS, "head_dim-disagrees", _set(head_dim=32), "head_dim (32) must equal"),
    (LLAMAS, "intermediate-disagrees", _set(intermediate_size=128), "in the weights but"),
    (LLAMAS, "hidden-disagrees", _set(hidden_size=128, head_dim=None), "in the weights but"),
    (LLAMAS, "unknown-rope-type", _set(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
    (LLAMAS, "rope-not-a-mapping", _set(rope_parameters="linear"), "rope_scaling: expected a mapping"),
    (LLAMAS, "rope-factor-below-one", _set(rope_parameters={"rope_type": "linear", "factor": 0.5}),
     "rope_scaling.factor must be a number >= 1"),
    (("mixtral",), "more-experts", _set(num_local_experts=5), "experts.4."),
    (("mixtral",), "fewer-experts", _set(num_local_experts=3, num_experts_per_tok=2), "experts.3."),
    (("mixtral",), "experts-per-token-above-experts", _set(num_experts_per_tok=5), "num_experts_per_tok (5)"),
    (("mixtral",), "missing-expert-count", _drop("num_local_experts"), "'num_local_experts' is missing"),
    (("mamba",), "d_model-disagrees", _set(hidden_size=128, intermediate_size=256), "in the weights but"),
    (("mamba",), "intermediate-disagrees", _set(intermediate_size=96), "intermediate_size (96) must equal"),
    (("mamba",), "state-size-disagrees", _set(state_size=16), "in the weights but"),
    (("mamba",), "zero-state-size", _set(state_size=0), "ssm_cfg.d_state must be >= 1 (got 0)"),
    (("mamba",), "conv-kernel-disagrees", _set(conv_kernel=3), "in the weights but"),
    (("mamba",), "time-step-rank-disagrees", _set(time_step_rank=8), "in the weights but"),
    (("mamba",), "bias-declared", _set(use_bias=True), "in_proj.bias', which the weights lack"),
    (("mamba",), "conv-bias-denied", _set(use_conv_bias=False), "conv1d.bias"),
]
CASES = [pytest.param(family, damage, names, id=f"{family}-{name}")
         for families, name, damage, names in VARIANTS for family in families]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Callable[[str], Path]:
    """A tiny model of a family saved by ``transformers`` (built once per module), norms away from 1."""
    root, saved = tmp_path_factory.mktemp("hf_models"), {}

    def get(family: str) -> Path:
        if family not in saved:
            prefix, arguments = FAMILIES[family]
            torch.manual_seed(0)
            model = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(**arguments))
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.uniform_(0.5, 1.5)
            model.save_pretrained(root / family)
            saved[family] = root / family
        return saved[family]

    return get


def damaged_copy(source: Path, target: Path, damage: Damage) -> Path:
    shutil.copytree(source, target)
    damage(target / "config.json")
    return target


def assert_nothing_written(folder: Path) -> None:
    assert sorted(path.name for path in folder.iterdir()) == ["hf"], "the conversion wrote something"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_undamaged_models_convert(family, hf_model, tmp_path):
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf_model(family), "--save-path", tmp_path / "ckpt")
    assert outcome.code == 0, outcome.stderr[-3000:]
    assert (tmp_path / "ckpt" / "checkpoint.json").exists()


@pytest.mark.parametrize("family, damage, names", CASES)
def test_broken_config_json_is_one_error_line_and_writes_nothing(family, damage, names, hf_model, tmp_path):
    hf = damaged_copy(hf_model(family), tmp_path / "hf", damage)
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", tmp_path / "ckpt")
    assert_user_error(outcome, "config.json", names)
    assert len(outcome.stderr.strip().splitlines()) == 1, outcome.stderr
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("damage, names", [
    (lambda hf: (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:100]),
     ["model.safetensors", "the file is corrupt"]),
    (lambda hf: shutil.copy(hf / "model.safetensors", hf / "model-copy.safetensors"),
     ["is stored in both", "model-copy.safetensors", "keep one of them"]),
], ids=["truncated", "duplicated"])
def test_broken_weight_files_are_one_error_line_and_write_nothing(damage, names, hf_model, tmp_path):
    shutil.copytree(hf_model("llama"), tmp_path / "hf")
    damage(tmp_path / "hf")
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", tmp_path / "hf", "--save-path", tmp_path / "ckpt")
    assert_user_error(outcome, *names)
    assert_nothing_written(tmp_path)


def test_python_m_nanotron_convert_reports_a_lying_config_json_in_one_line(hf_model, tmp_path):
    hf = damaged_copy(hf_model("llama"), tmp_path / "hf", _set(vocab_size=400))
    result = subprocess.run([sys.executable, "-m", "nanotron", "convert", "hf-to-nanotron", "--hf-path", str(hf),
                             "--save-path", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300)
    outcome = Outcome(result.returncode, result.stdout, result.stderr)
    line = assert_user_error(outcome, "does not match the weights", "'embed_tokens.weight'", "(384, 64)", "(400, 64)")
    assert result.stderr.strip() == line
    assert_nothing_written(tmp_path)


@pytest.fixture(scope="module")
def converted_llama(hf_model, tiny_data, tmp_path_factory) -> Path:
    """The tiny Llama (128 positions) converted to nanotron with the tiny corpus's tokenizer."""
    from nanotron.checkpoint.hf import hf_to_nanotron

    root = tmp_path_factory.mktemp("converted")
    shutil.copytree(hf_model("llama"), root / "hf")
    shutil.copy(tiny_data["tokenizer"], root / "hf" / "tokenizer.json")
    return hf_to_nanotron(root / "hf", root / "ckpt")


def run_nanotron(*args) -> Outcome:
    result = subprocess.run([sys.executable, "-m", "nanotron", *map(str, args)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "NANOTRON_DEVICE": "cpu"})
    return Outcome(result.returncode, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def short_data(tiny_data, tmp_path_factory) -> Path:
    """A tokenized folder of one short sentence: fewer tokens than one window of 32 + 1."""
    from nanotron.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("short")
    (root / "short.jsonl").write_text(json.dumps({"text": "the cat runs."}) + "\n")
    preprocess([root / "short.jsonl"], tiny_data["tokenizer"], root / "short", num_workers=1)
    return root / "short"


def test_eval_on_data_shorter_than_one_window_is_an_error(converted_llama, short_data, tmp_path):
    from nanotron.data.dataset import TokenShards

    tokens = TokenShards(short_data).num_tokens
    outcome = run_nanotron("eval", "--ckpt-path", converted_llama, "--data", short_data, "--sequence-length", 32,
                           "--output", tmp_path / "eval.json")
    assert_user_error(outcome, str(short_data), f"holds {tokens} tokens, fewer than one evaluation window",
                      f"pass --sequence-length {tokens - 1} or less")
    assert "perplexity" not in outcome.stdout and not (tmp_path / "eval.json").exists()
    # the suggested length evaluates; no window at all is an error too
    fitting = cli("eval", "--ckpt-path", converted_llama, "--data", short_data, "--sequence-length", tokens - 1)
    assert fitting.code == 0 and f"| {tokens - 1} tokens" in fitting.stdout, fitting.stderr[-3000:]
    nothing = cli("eval", "--ckpt-path", converted_llama, "--data", short_data, "--sequence-length", 2,
                  "--max-windows", 0)
    assert_user_error(nothing, "argument --max-windows: must be at least 1 (got 0)")


def test_generation_past_the_context_is_an_error(converted_llama):
    outcome = run_nanotron("generate", "--ckpt-path", converted_llama, "--prompt", "the cat", "--max-new-tokens", 200)
    line = assert_user_error(outcome, "--max-new-tokens (200)", "more than the 128 the model was trained for "
                                                                "(max_position_embeddings)")
    assert "===" not in outcome.stdout  # nothing was generated
    # the largest length it suggests fits exactly; none at all is an error too
    most = int(line.split("pass --max-new-tokens ")[1].split()[0])
    fitting = cli("generate", "--ckpt-path", converted_llama, "--prompt", "the cat", "--max-new-tokens", most)
    assert fitting.code == 0 and "=== the cat" in fitting.stdout, fitting.stderr[-3000:]
    one_more = cli("generate", "--ckpt-path", converted_llama, "--prompt", "the cat", "--max-new-tokens", most + 1)
    assert_user_error(one_more, f"--max-new-tokens ({most + 1})")
    assert_user_error(cli("generate", "--ckpt-path", converted_llama, "--prompt", "the cat", "--max-new-tokens", 0),
                      "argument --max-new-tokens: must be at least 1 (got 0)")
