"""Continued pretraining of real checkpoints: RoPE scaling (Llama 3.1 ``llama3``, ``linear``), Qwen2 (q/k/v biases,
tied or untied, sliding windows), SmolLM3 (NoPE layers), Mixtral (mixtures of experts), MLPs of other activations
than SiLU and the shape rules checked before a model is built, against random small ``transformers`` models; a
broken or lying config.json or weight file of each family is one ``error:`` line and writes nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import ROOT
from support.configs import tiny_config_dict, tp_config, write_config
from support.distributed import run_distributed, run_distributed_each
from support.hf import FAMILIES, PROMPTS, away_from_initial_values, save_tiny_hf_model
from support.parity import assemble, check_against_reference, parity_run
from support.runs import Outcome, assert_user_error, cli

NEW_TOKENS = 24
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # a short pretraining context: every band of head_dim 16 is hit
LINEAR = {"rope_type": "linear", "factor": 4.0}
# Weights of std 0.1 rather than 0.02: greedy continuations then vary instead of repeating one or two tokens.
SHAPE = dict(vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0, bos_token_id=1, eos_token_id=2,
             initializer_range=0.1)
# transformers model family and config arguments; transformers is imported by the tests that need it, not by the
# spawned ranks.
VARIANTS = {
    "llama3": ("Llama", {"rope_scaling": LLAMA3}),
    "linear": ("Llama", {"rope_scaling": LINEAR}),
    "qwen2-tied": ("Qwen2", {"tie_word_embeddings": True}),
    "qwen2-untied": ("Qwen2", {"tie_word_embeddings": False}),
    # windows of 3 (shorter than the prompts and the generated text) on the last layer; SmolLM3 with a NoPE layer
    "qwen2-window": ("Qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
    "smollm3": ("SmolLM3", {"no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 3,
                            "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # other gated activations than SiLU, in a dense MLP and in experts, split over tp ranks too
    "llama-relu": ("Llama", {"hidden_act": "relu"}),
    "mixtral-gelu-tanh": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                      "hidden_act": "gelu_pytorch_tanh"}),
}


def hf_config(family: str, **changes):
    transformers = pytest.importorskip("transformers")
    arguments = SHAPE | {name: dict(value) if isinstance(value, dict) else value for name, value in changes.items()}
    return getattr(transformers, f"{family}Config")(**arguments)  # copies: transformers adds keys to rope dicts


def save_random(family: str, folder: Path, **changes) -> Path:
    """Norms away from 1 and biases away from 0 (transformers starts them there), so a lost tensor would show."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(hf_config(family, **changes)).eval()
    away_from_initial_values(model).save_pretrained(folder, safe_serialization=True)
    return folder


def _reference(hf_path: Path) -> dict:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_path).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits = model(ids).logits[0]
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return {"logits": logits, "greedy": greedy}


def _nanotron(ckpt: str, tp: int) -> dict:
    """Logits of the first prompt and greedy continuations of the batch; later calls in the same processes reuse
    the process group (re-creating it on the same port races with the old one's teardown)."""
    from nanotron.generation.generate import SamplingArgs, forward_logits, generate, load_model
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=tp))
    model, _ = load_model(Path(ckpt), pc)
    vocab = model.config.vocab_size
    logits = forward_logits(model, pc, torch.tensor([PROMPTS[0]]), None, None, None, last_only=False)
    greedy = generate(model, pc, PROMPTS, NEW_TOKENS, SamplingArgs("greedy"), None, vocab)
    return {"logits": logits[0, :, :vocab], "greedy": greedy}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, dict]:
    """Every variant saved by transformers and converted to a nanotron checkpoint."""
    from nanotron.checkpoint.hf import hf_to_nanotron

    root = tmp_path_factory.mktemp("real")
    out = {}
    for name, (family, changes) in VARIANTS.items():
        hf = save_random(family, root / name, **changes)
        out[name] = {"hf": hf, "ckpt": hf_to_nanotron(hf, root / f"{name}-nanotron")}
    return out


@pytest.fixture(scope="module")
def models(converted) -> dict[str, dict]:
    """Each converted variant with transformers' reference outputs, and nanotron's at tp 1 and tp 2 (one spawn per
    tp for all variants: starting processes is the slow part)."""
    out = {name: entry | _reference(entry["hf"]) for name, entry in converted.items()}
    for tp in (1, 2):
        calls = [{"ckpt": str(entry["ckpt"]), "tp": tp} for entry in out.values()]
        for entry, ranks in zip(out.values(), run_distributed_each(_nanotron, tp, calls)):
            entry[tp] = ranks
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.slow
def test_logits_and_greedy_generation_match_transformers_at_tp_1_and_2(models, name):
    entry = models[name]
    for tp in (1, 2):
        for rank in entry[tp]:
            assert (rank["logits"] - entry["logits"]).abs().max() < 1e-4, (tp, name)
            assert rank["greedy"] == entry["greedy"], (tp, name)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_round_trip_is_bit_identical_and_keeps_the_config(converted, name, tmp_path):
    from nanotron.checkpoint.hf import nanotron_to_hf

    transformers = pytest.importorskip("transformers")
    hf_path = converted[name]["hf"]
    exported = nanotron_to_hf(converted[name]["ckpt"], tmp_path / "back")
    original, back = load_file(hf_path / "model.safetensors"), load_file(exported / "model.safetensors")
    assert set(back) == set(original)
    for tensor_name, tensor in back.items():
        assert torch.equal(tensor, original[tensor_name]), tensor_name
    before, after = (transformers.AutoConfig.from_pretrained(path) for path in (hf_path, exported))
    assert type(after) is type(before) and after.architectures == before.architectures
    assert after.rope_parameters == before.rope_parameters
    written = json.loads((exported / "config.json").read_text())
    assert written["rope_scaling"] == {"llama3": LLAMA3, "linear": LINEAR}.get(name)
    _, loading = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]


def test_llama3_frequencies_are_those_of_transformers():
    from nanotron.nn.rotary import scaled_inv_freq

    llama3 = pytest.importorskip("transformers.modeling_rope_utils").ROPE_INIT_FUNCTIONS["llama3"]
    expected, _ = llama3(hf_config("Llama", rope_scaling=LLAMA3), "cpu")
    plain = 1.0 / (5000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    scaled = scaled_inv_freq(plain, LLAMA3)
    assert torch.equal(scaled, expected)
    assert (scaled == plain).any() and (scaled == plain / 8).any() and ((scaled != plain) & (scaled != plain / 8)).any()


def test_costs_count_the_qkv_biases():
    from nanotron.config import LlamaConfig
    from nanotron.models.llama.costs import llama_costs
    from nanotron.models.llama.model import LlamaForCausalLM

    config = LlamaConfig(**SHAPE | {"attention_bias": True})
    model = LlamaForCausalLM(config, 112)
    assert llama_costs(config, 112, 16).parameters == sum(p.numel() for p in model.parameters())


def test_row_parallel_biases_are_refused():
    from torch import nn

    from nanotron.parallel.tensor_parallel import ALL_REDUCE, Row, apply_tensor_parallel

    holder = nn.Module()
    holder.o_proj = nn.Linear(8, 8, bias=True)
    with pytest.raises(ValueError, match="o_proj \\(Row\\) with a bias is not supported: only column-parallel"):
        apply_tensor_parallel(holder, {"o_proj": Row()}, None, ALL_REDUCE)


@pytest.mark.full_tier
def test_training_with_qkv_biases_matches_at_tp_2(tiny_data, tmp_path):
    def config(name: str, tp: int, mode: str, overlap: bool = False) -> dict:
        cfg = tp_config(tiny_data, tmp_path, name, tp, mode, overlap)
        cfg["model"]["model_config"]["attention_bias"] = True
        return cfg

    (reference,) = run_distributed(parity_run, 1, config=config("ref", 1, "ALL_REDUCE"))
    variants = [("ALL_REDUCE", False), ("REDUCE_SCATTER", True)]
    calls = [{"config": config(f"{mode}-{overlap}", 2, mode, overlap)} for mode, overlap in variants]
    bias = "layers.0.attn.qkv_proj.bias"
    assert assemble([reference], "grads")[bias].abs().max() > 0  # compared below with every other gradient
    for variant, results in zip(variants, run_distributed_each(parity_run, 2, calls)):
        assert results[0]["local_shapes"][bias] == (64,)  # half of each of q, k and v
        check_against_reference(reference, results, 2, variant)
        for expected, got in zip(reference["metrics"], results[0]["metrics"], strict=True):
            assert got["lm_loss"] == pytest.approx(expected["lm_loss"], abs=1e-5), (variant, got["step"])


# --- shape rules and config errors --------------------------------------------------------------------------------

SMOLLM2_LIKE = ("--tp (2) must divide model.config.num_attention_heads (9), and divide or be a multiple of "
                "model.config.num_key_value_heads (3)")


@pytest.fixture(scope="module")
def smollm2_like(tmp_path_factory) -> Path:
    """A converted checkpoint with SmolLM2-135M's head layout (9 heads, 3 kv heads), scaled down."""
    from nanotron.checkpoint.hf import hf_to_nanotron

    root = tmp_path_factory.mktemp("smollm2")
    hf = save_random("Llama", root / "hf", hidden_size=72, num_attention_heads=9, num_key_value_heads=3)
    return hf_to_nanotron(hf, root / "nanotron")


def _run_cli(*args: str, launcher: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "NANOTRON_DEVICE": "cpu", "OMP_NUM_THREADS": "1"})


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str, traceback: bool = False) -> None:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert all(fragment in errors[0] for fragment in fragments), errors[0]
    assert traceback or "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_generate_and_eval_refuse_a_tp_that_splits_kv_heads(smollm2_like):
    generated = _run_cli(str(ROOT / "run_generate.py"), "--ckpt-path", str(smollm2_like), "--tp", "2", "--prompt", "hi")
    assert generated.returncode == 2
    assert_one_error_line(generated, SMOLLM2_LIKE, "set --tp to one of 1, 3, 9")
    evaluated = _run_cli("-m", "nanotron", "eval", "--ckpt-path", str(smollm2_like), "--data", "unused", "--tp", "2",
                         "--sequence-length", "64")
    assert evaluated.returncode == 2
    assert_one_error_line(evaluated, SMOLLM2_LIKE)


@pytest.mark.slow
def test_eval_refuses_sequences_longer_than_the_context(smollm2_like):
    evaluated = _run_cli("-m", "nanotron", "eval", "--ckpt-path", str(smollm2_like), "--data", "unused",
                         "--sequence-length", "512")
    assert evaluated.returncode == 2
    assert_one_error_line(evaluated, "--sequence-length (512) exceeds model.config.max_position_embeddings (128)")


@pytest.mark.full_tier
def test_training_refuses_a_tp_that_splits_kv_heads_once_per_launch(smollm2_like, tiny_data, tmp_path):
    config = tiny_config_dict(tiny_data, tmp_path / "ckpt", parallelism={"tp": 2})
    config["model"]["init_method"] = {"path": str(smollm2_like)}
    config["model"]["model_config"] |= {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3}
    path = str(write_config(tmp_path / "config.yaml", config))
    expected = ("parallelism.tp (2) must divide model.model_config.num_attention_heads (9), and divide or be a "
                "multiple of model.model_config.num_key_value_heads (3)", "set parallelism.tp to one of 1, 3, 9")
    single = _run_cli(str(ROOT / "run_train.py"), "--config-file", path)
    assert single.returncode == 2
    assert_one_error_line(single, *expected)
    # Both ranks refuse the config, rank 0 alone says so (torchrun then reports the failed ranks its own way).
    torchrun = (str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=2")
    launched = _run_cli(str(ROOT / "run_train.py"), "--config-file", path, launcher=torchrun)
    assert launched.returncode != 0
    assert_one_error_line(launched, *expected, traceback=True)


@pytest.mark.parametrize("scaling, fragments", [
    ({"rope_type": "dynamic", "factor": 4.0}, ["model.model_config.rope_scaling.rope_type must be one of linear, "
                                               "llama3, yarn", "'dynamic'"]),
    ({k: v for k, v in LLAMA3.items() if k != "factor"}, ["model.model_config.rope_scaling misses factor",
                                                          "rope_type llama3 takes exactly the keys"]),
    ({"factor": 2.0}, ["model.model_config.rope_scaling.rope_type must be one of", "None"]),
    (LINEAR | {"low_freq_factor": 1.0}, ["model.model_config.rope_scaling has unknown key low_freq_factor"]),
    (LLAMA3 | {"high_freq_factor": 0.5}, ["model.model_config.rope_scaling.low_freq_factor (1.0)", "0.5"]),
    (LINEAR | {"factor": "big"}, ["model.model_config.rope_scaling.factor must be a number >= 1 (got 'big')"]),
], ids=["unknown-type", "missing-factor", "no-type", "unknown-key", "bad-band", "bad-factor"])
def test_bad_rope_scaling_is_one_error_line_naming_the_key(tiny_data, tmp_path, capsys, scaling, fragments):
    from nanotron.cli import main

    config = tiny_config_dict(tiny_data, tmp_path / "ckpt")
    config["model"]["model_config"]["rope_scaling"] = scaling
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config-file", str(write_config(tmp_path / "config.yaml", config))])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error:") and all(fragment in line for fragment in fragments), line


def test_conversion_refuses_unsupported_rope(tmp_path):
    from nanotron.checkpoint.hf import hf_to_nanotron
    from nanotron.errors import CheckpointError

    cases = {"dynamic": (hf_config("Llama").to_dict() | {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
                         "rope type 'dynamic' (RoPE scaling) is not supported; supported: default, linear, llama3, "
                         "yarn")}
    for name, (raw, message) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        with pytest.raises(CheckpointError, match=re.escape(message)):
            hf_to_nanotron(tmp_path / name, tmp_path / f"{name}-out")


# --- broken or lying config.json and weight files -------------------------------------------------------------------

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
DAMAGES = [
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
    (LLAMAS, "unknown-rope-type", _set(rope_parameters={"rope_type": "dynamic", "factor": 4.0}), "'dynamic'"),
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
         for families, name, damage, names in DAMAGES for family in families]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Callable[[str], Path]:
    """A tiny model of a family saved by ``transformers`` (built once per module), norms away from 1."""
    root, saved = tmp_path_factory.mktemp("hf_models"), {}

    def get(family: str) -> Path:
        if family not in saved:
            saved[family] = save_tiny_hf_model(family, root / family)
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
