"""Hugging Face interop and generation: conversion both ways, logits parity at any layout, greedy decoding; every
activation of the gated MLPs, every config.json field classified, weights that cannot convert refused, and the
tokenizer's bos and eos ids in exports; an export never leaves a half-written folder."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import ROOT
from support.configs import tiny_config_dict
from support.distributed import run_distributed
from support.hf import PROMPTS, nanotron_outputs
from support.runs import assert_user_error, cli, fresh_environment, train_through_cli

transformers = pytest.importorskip("transformers")


def random_hf_llama(folder: Path, tied: bool) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 so that a missing weight would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def converted(request, tmp_path_factory):
    from nanotron.checkpoint.hf import hf_to_nanotron

    root = tmp_path_factory.mktemp("hf")
    hf = random_hf_llama(root / "hf", tied=request.param)
    return hf, hf_to_nanotron(hf, root / "nanotron")


def hf_logits_and_greedy(hf_path: Path) -> tuple[torch.Tensor, list[list[int]]]:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_path).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits = model(ids).logits[0]
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    return logits, out[0, ids.shape[1]:].tolist()


@pytest.mark.full_tier
def test_logits_and_generation_match_transformers_at_every_layout(converted):
    hf_path, ckpt = converted
    reference_logits, reference_greedy = hf_logits_and_greedy(hf_path)
    (single,) = run_distributed(nanotron_outputs, 1, ckpt=str(ckpt), tp=1, pp=1)
    assert (single["logits"] - reference_logits).abs().max() < 1e-4
    assert single["cached"] == single["uncached"]  # the KV cache changes nothing (64 tokens, batched prompts)
    assert single["cached"][0][:24] == reference_greedy

    sharded = run_distributed(nanotron_outputs, 4, ckpt=str(ckpt), tp=2, pp=2)
    last_stage = [r for r in sharded if r["logits"] is not None]
    assert len(last_stage) == 2
    assert (last_stage[0]["logits"] - reference_logits).abs().max() < 1e-4
    assert all(r["cached"] == single["cached"] for r in sharded)


def test_round_trip_is_bit_identical(converted, tmp_path):
    from nanotron.checkpoint.hf import nanotron_to_hf

    hf_path, ckpt = converted
    exported = nanotron_to_hf(ckpt, tmp_path / "back")
    original, back = load_file(hf_path / "model.safetensors"), load_file(exported / "model.safetensors")
    assert set(back) == set(original) - {"lm_head.weight"} or set(back) == set(original)
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name
    transformers.LlamaForCausalLM.from_pretrained(exported)  # loads without missing or unexpected keys


def test_a_converted_checkpoint_records_the_layout_of_one_process(converted):
    """Its record names every axis, as a training checkpoint's does, so that it compares like one."""
    import json

    from nanotron.layout import Layout

    _, ckpt = converted
    assert json.loads((ckpt / "checkpoint.json").read_text())["layout"] == Layout().to_dict()


MEMORIZE = "the quick brown fox jumps over the lazy dog near the river bank today"


@pytest.mark.slow
def test_memorized_sentence_comes_back_from_run_generate(tmp_path):
    import json

    from nanotron.data.preprocess import preprocess
    from nanotron.data.tokenizer import train_tokenizer
    from support.configs import write_config

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": MEMORIZE}) + "\n" for _ in range(300)))
    tokenizer = train_tokenizer([corpus], 300, tmp_path / "tokenizer.json")
    preprocess([corpus], tokenizer, tmp_path / "data", num_workers=1)
    from support.configs import tiny_config_dict

    config = tiny_config_dict({"tokenizer": tokenizer, "tokenized": tmp_path / "data"}, tmp_path / "ckpt",
                              tokens={"train_steps": 80})
    config["model"]["model_config"] |= {"vocab_size": 300}
    env = fresh_environment()
    trained = subprocess.run([sys.executable, str(ROOT / "run_train.py"), "--config-file",
                              str(write_config(tmp_path / "config.yaml", config))],
                             capture_output=True, text=True, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    generated = subprocess.run([sys.executable, str(ROOT / "run_generate.py"), "--ckpt-path", str(tmp_path / "ckpt"),
                                "--prompt", "the quick brown fox", "--max-new-tokens", "12"],
                               capture_output=True, text=True, env=env)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert "jumps over the lazy dog near the river" in generated.stdout


def test_samplers_respect_top_k_top_p_and_seed():
    from nanotron.generation.generate import SamplingArgs, sample

    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0, -1.0]]).repeat(200, 1)
    draw = lambda args, seed: sample(logits, args, torch.Generator().manual_seed(seed))  # noqa: E731
    assert set(draw(SamplingArgs("top-k", top_k=2), 0).tolist()) == {0, 1}
    assert set(draw(SamplingArgs("top-p", top_p=0.5), 0).tolist()) == {0}  # token 0 alone holds > 50%
    assert set(draw(SamplingArgs("top-k", top_k=5, temperature=100.0), 0).tolist()) == {0, 1, 2, 3, 4}
    assert torch.equal(draw(SamplingArgs("top-p"), 3), draw(SamplingArgs("top-p"), 3))
    assert torch.equal(draw(SamplingArgs("greedy"), 0), torch.zeros(200, dtype=torch.long))


def _evaluate(ckpt: str, data: str, tp: int) -> dict:
    import torch.nn.functional as F

    from nanotron.data.dataset import TokenShards
    from nanotron.generation.evaluate import evaluate
    from nanotron.generation.generate import load_model
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=tp))
    result = evaluate(Path(ckpt), [Path(data)], pc, sequence_length=16, max_windows=10, batch_size=4)
    if tp > 1:
        return result
    model, _ = load_model(Path(ckpt), pc)
    shards = TokenShards(Path(data))
    tokens = torch.stack([torch.as_tensor(shards.read(i * 16, 17)) for i in range(10)])
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1])
    manual = F.cross_entropy(logits[..., :384].flatten(0, 1), tokens[:, 1:].flatten()).item()
    return result | {"manual": manual}


@pytest.mark.full_tier
def test_eval_reports_the_mean_token_loss_at_any_layout(tiny_data, tmp_path):
    from support.configs import tiny_config_dict, write_config

    config = tiny_config_dict(tiny_data, tmp_path / "ckpt", tokens={"train_steps": 6})
    trained = subprocess.run([sys.executable, str(ROOT / "run_train.py"), "--config-file",
                              str(write_config(tmp_path / "config.yaml", config))], capture_output=True, text=True,
                             env=fresh_environment())
    assert trained.returncode == 0, trained.stderr[-3000:]
    (single,) = run_distributed(_evaluate, 1, ckpt=str(tmp_path / "ckpt"), data=str(tiny_data["tokenized"]), tp=1)
    sharded = run_distributed(_evaluate, 2, ckpt=str(tmp_path / "ckpt"), data=str(tiny_data["tokenized"]), tp=2)
    result = single["tokenized"]
    assert result["tokens"] == 160 and result["loss"] == pytest.approx(single["manual"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(torch.tensor(result["loss"]).exp().item(), rel=1e-6)
    assert sharded[0]["tokenized"]["loss"] == pytest.approx(result["loss"], rel=1e-5)


def _converted_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """The logits of a nanotron checkpoint over ``ids``, in this process at tp=1."""
    from nanotron.generation.generate import forward_logits, load_model
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=1))
    try:
        model, _ = load_model(ckpt, pc)
        return forward_logits(model, pc, ids, None, None, None, last_only=False)[0, :, :model.config.vocab_size]
    finally:
        pc.destroy()


# transformers families whose MLP (and experts) take config.json's hidden_act, with the config of a tiny one
GATED_FAMILIES = {
    "Llama": {},
    "Qwen2": {},
    "Qwen2Moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 48, "mlp_only_layers": [0]},
    "Mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
# Each family with one activation in the default tier (every activation among them), all pairs in the full tier.
DEFAULT_TIER_ACTIVATIONS = {"Llama": "gelu", "Qwen2": "gelu_pytorch_tanh", "Qwen2Moe": "relu", "Mixtral": "gelu"}


@pytest.mark.parametrize("family, activation", [
    pytest.param(family, activation, marks=() if DEFAULT_TIER_ACTIVATIONS[family] == activation
                 else pytest.mark.full_tier)
    for family in GATED_FAMILIES for activation in ("gelu", "gelu_pytorch_tanh", "relu")])
def test_hidden_act_converts_with_the_logits_of_transformers_and_back(family, activation, tmp_path):
    from support.hf import away_from_initial_values
    from support.runs import cli

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, hidden_act=activation,
        **GATED_FAMILIES[family])
    model = away_from_initial_values(getattr(transformers, f"{family}ForCausalLM")(config).eval())
    model.save_pretrained(tmp_path / "hf")
    for direction, source, target in (("hf-to-nanotron", "--hf-path", "nanotron"),
                                      ("nanotron-to-hf", "--ckpt-path", "back")):
        outcome = cli("convert", direction, source, tmp_path / ("hf" if target == "nanotron" else "nanotron"),
                      "--save-path", tmp_path / target)
        assert outcome.code == 0, outcome.stderr[-3000:]
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        reference = model(ids).logits[0]
    assert (_converted_logits(tmp_path / "nanotron", ids) - reference).abs().max() < 1e-4
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert exported.config.hidden_act == activation
    with torch.no_grad():
        assert torch.equal(exported(ids).logits[0], reference)


def test_gated_activations_keep_only_gate_up_for_the_backward():
    """The memory planner counts a gated MLP's kept activations as SwiGLU's: gate|up and the output, whatever the
    activation; and the gradients are those of transformers' activation."""
    from transformers.activations import ACT2FN

    from nanotron.nn.glu import glu

    for activation in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
        gate_up = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: t):
            out = glu(gate_up, activation)
        assert [t.data_ptr() for t in saved] == [gate_up.data_ptr()], activation
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(out, ACT2FN[activation](gate) * up), activation
        assert torch.autograd.gradcheck(glu, (gate_up, activation)), activation


def test_every_field_of_transformers_configs_is_read_ignored_or_refused():
    """Each family's table classifies every field of the installed transformers' config class of each model_type it
    converts: a field a new transformers adds fails here until it is classified."""
    import inspect

    from nanotron.models.hf_fields import Ignored, Read, Refused
    from nanotron.models.registry import MODEL_SPECS

    tables = {model_type: fields for spec in MODEL_SPECS.values() for model_type, fields in
              spec.hf_adapter.hf_fields.items()}
    assert set(tables) == {"llama", "qwen2", "smollm3", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral", "mamba",
                           "deepseek_v3"}
    for model_type, fields in tables.items():
        config_class = transformers.CONFIG_MAPPING[model_type]
        declared = set(inspect.signature(config_class.__init__).parameters) | set(config_class().to_dict())
        assert declared - {"self", "kwargs"} - set(fields) == set(), model_type
        assert all(isinstance(field, (Read, Ignored, Refused)) for field in fields.values())


class _RecordingDict(dict):
    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def test_adapters_read_only_the_fields_their_tables_say_they_read():
    from nanotron.models.hf_fields import Read
    from nanotron.models.registry import MODEL_SPECS

    for spec in MODEL_SPECS.values():
        for model_type, fields in spec.hf_adapter.hf_fields.items():
            hf = _RecordingDict(transformers.CONFIG_MAPPING[model_type](
                vocab_size=112, hidden_size=64, num_hidden_layers=2).to_dict())
            spec.hf_adapter.config_fields_from_hf(hf)
            assert "vocab_size" in hf.read, model_type
            assert hf.read - {name for name, field in fields.items() if isinstance(field, Read)} == set(), model_type


@pytest.mark.parametrize("model_type, change, fragment", [
    ("llama", {"hidden_act": "gelu_new"}, "hidden_act must be one of silu, gelu, gelu_pytorch_tanh, relu"),
    ("llama", {"mlp_bias": True}, "mlp_bias True is not supported (nanotron's MLP has no biases); only False is"),
    ("llama", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config {'quant_method'"),
    ("mamba", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("mixtral", {"sliding_window": 4096}, "sliding_window 4096 is not supported"),
    ("qwen2", {"is_encoder_decoder": True}, "is_encoder_decoder True is not supported"),
])
def test_conversion_refuses_a_field_it_does_not_build_in_one_line_writing_nothing(model_type, change, fragment,
                                                                                   tmp_path):
    import json

    from support.runs import assert_user_error, cli

    hf = tmp_path / "hf"
    torch.manual_seed(0)
    config = transformers.CONFIG_MAPPING[model_type](vocab_size=112, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    written = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(written | change))
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", tmp_path / "out")
    assert_user_error(outcome, str(hf / "config.json"), fragment)
    assert not (tmp_path / "out").exists()


def test_keys_that_no_transformers_field_names_are_ignored_with_one_warning(tmp_path, caplog):
    import json

    from nanotron.checkpoint.hf_folder import read_hf_config

    hf = random_hf_llama(tmp_path / "hf", tied=True)
    written = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(written | {"fused_add_norm": True, "n_layer": 4}))
    with caplog.at_level("WARNING", logger="nanotron.convert"):
        read_hf_config(hf)
    (record,) = caplog.records
    assert "ignored the keys fused_add_norm, n_layer" in record.getMessage()


def _fields_table() -> str:
    """docs/checkpoint-format.md's table of config.json fields, rendered from the families' ``hf_fields``: one row
    per field and treatment, with the model types that treat it so."""
    from nanotron.models.hf_fields import Ignored, Read
    from nanotron.models.registry import MODEL_SPECS

    tables = {model_type: fields for spec in MODEL_SPECS.values() for model_type, fields in
              spec.hf_adapter.hf_fields.items()}
    rows: dict[tuple[str, str], list[str]] = {}
    for model_type, fields in tables.items():
        for name, field in fields.items():
            if isinstance(field, Read):
                treatment = f"read: {field.into}"
            elif isinstance(field, Ignored):
                treatment = f"ignored: {field.reason}"
            else:
                allowed = " or ".join("null" if value is None else f"`{value!r}`" for value in field.allowed)
                treatment = f"refused unless {allowed}: {field.reason}"
            rows.setdefault((name, treatment), []).append(model_type)
    lines = ["| Field | Model types | Conversion |", "|---|---|---|"]
    for (name, treatment), model_types in sorted(rows.items()):
        types = "all" if len(model_types) == len(tables) else ", ".join(model_types)
        lines.append(f"| `{name}` | {types} | {treatment} |")
    return "\n".join(lines) + "\n"


def test_the_docs_list_every_field_as_the_tables_treat_it():
    docs = (ROOT / "docs" / "checkpoint-format.md").read_text()
    assert _fields_table() in docs, "regenerate the table of docs/checkpoint-format.md with _fields_table()"


@pytest.mark.parametrize("value, fragment", [
    (float("nan"), "holds 1 NaN or infinite values"),
    (float("-inf"), "holds 1 NaN or infinite values"),
    (7, "is stored as I8, not one of the floating-point dtypes nanotron converts (F64, F32, BF16, F16)"),
])
def test_conversion_refuses_non_finite_or_integer_weights_by_name_writing_nothing(value, fragment, tmp_path):
    from safetensors.torch import save_file

    from support.runs import assert_user_error, cli

    hf = random_hf_llama(tmp_path / "hf", tied=True)
    weights = load_file(hf / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    if isinstance(value, float):
        weights[name][3, 5] = value
    else:
        weights[name] = torch.full_like(weights[name], value, dtype=torch.int8)
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", tmp_path / "out")
    assert_user_error(outcome, f"'{name}' in {hf / 'model.safetensors'}", fragment)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


class _Scripted(transformers.LogitsProcessor):
    """Forces generation to emit ``script`` after a prompt of ``prompt_length`` tokens, then its last token."""

    def __init__(self, script: list[int], prompt_length: int):
        self.script, self.prompt_length = script, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = min(input_ids.shape[1] - self.prompt_length, len(self.script) - 1)
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.script[step]] = 0.0
        return forced


@pytest.fixture(scope="module")
def run_with_default_token_ids(tiny_data, tmp_path_factory) -> Path:
    """A quickstart-like run whose config leaves bos and eos at the schema's defaults (1 and 2: ``!`` and ``"`` of
    the tiny byte-level BPE)."""
    from support.configs import tiny_config_dict
    from support.runs import train_through_cli

    root = tmp_path_factory.mktemp("default_token_ids")
    train_through_cli(tiny_config_dict(tiny_data, root / "run", tokens={"train_steps": 2}), root / "config.yaml")
    return root / "run"


def _export(run: Path, target: Path) -> dict:
    """config.json of ``run`` exported by the CLI into ``target``."""
    import json

    from support.runs import cli

    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", run, "--save-path", target)
    assert outcome.code == 0, outcome.stderr[-3000:]
    return json.loads((target / "config.json").read_text())


@pytest.mark.slow
def test_an_exported_run_stops_generating_at_its_tokenizers_end_of_text_only(run_with_default_token_ids, tiny_data,
                                                                             tmp_path):
    """Training takes the tokenizer's ids in place of the defaults, and the export writes them: transformers'
    generate goes on past ``"`` and stops at ``<|endoftext|>``."""
    from nanotron.data.tokenizer import EOS_TOKEN, load_tokenizer
    from support.runs import checkpoint_json

    tokenizer = load_tokenizer(tiny_data["tokenizer"])
    end, quote = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id('"')
    assert quote == 2 and end != 2
    trained = checkpoint_json(run_with_default_token_ids)["model"]["config"]
    assert (trained["bos_token_id"], trained["eos_token_id"]) == (None, end)
    written = _export(run_with_default_token_ids, tmp_path / "hf")
    assert (written["bos_token_id"], written["eos_token_id"]) == (None, end)

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = torch.tensor([tokenizer.encode("the river").ids])
    script = [quote, 5, quote, end, 7]
    out = model.generate(prompt, max_new_tokens=len(script), do_sample=False, pad_token_id=end,
                         logits_processor=[_Scripted(script, prompt.shape[1])])
    assert out[0, prompt.shape[1]:].tolist() == [quote, 5, quote, end]


@pytest.mark.parametrize("bos, eos, warned", [
    (1, 2, None),
    (None, 5, "eos_token_id (5 ('%')) is an ordinary token of its tokenizer; exported the tokenizer's own, "
              "0 ('<|endoftext|>')"),
    (3, 0, "bos_token_id (3 ('#')) is an ordinary token of its tokenizer; exported the tokenizer's own, null"),
])
def test_export_takes_the_tokenizers_ids_where_the_checkpoint_has_ordinary_tokens(run_with_default_token_ids, bos,
                                                                                   eos, warned, tmp_path, caplog):
    """A checkpoint trained before the ids were taken from the tokenizer carries the defaults, exported as the
    tokenizer's; other ordinary tokens are exported as the tokenizer's too, with a warning naming them."""
    import json
    import shutil

    from nanotron.checkpoint.integrity import sealed

    run = shutil.copytree(run_with_default_token_ids, tmp_path / "run")
    checkpoint = run / (run / "latest.txt").read_text().strip() / "checkpoint.json"
    metadata = json.loads(checkpoint.read_text())
    metadata["model"]["config"] |= {"bos_token_id": bos, "eos_token_id": eos}
    checkpoint.write_text(json.dumps(sealed(metadata)))  # as a save with these ids writes it
    with caplog.at_level("WARNING", logger="nanotron.convert"):
        written = _export(run, tmp_path / "hf")
    assert (written["bos_token_id"], written["eos_token_id"]) == (None, 0)
    assert [record.getMessage() for record in caplog.records] == ([] if warned is None else
                                                                  [f"the checkpoint's {warned}"])


# --- exports that never leave a half-written folder -----------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A run folder trained one step with the tiny config."""

    root = tmp_path_factory.mktemp("trained")
    config = tiny_config_dict(tiny_data, root / "run", tokens={"train_steps": 1})
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    train_through_cli(config, root / "config.yaml")
    return root / "run"


@pytest.mark.slow
def test_a_failed_export_to_hugging_face_leaves_the_earlier_export_whole(trained, tmp_path, monkeypatch):
    """The tokenizer copy fails half-way (a file-size limit reached: EFBIG) while an earlier export is in the
    target: the earlier export keeps every byte, and nothing half-written is left beside it. The next export
    replaces it."""
    from nanotron.checkpoint.hf import nanotron_to_hf

    target = nanotron_to_hf(trained, tmp_path / "hf")
    earlier = {path.name: path.read_bytes() for path in target.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(earlier)
    config = json.loads(earlier["config.json"])
    config["note"] = "the earlier export"
    (target / "config.json").write_text(json.dumps(config))
    earlier["config.json"] = (target / "config.json").read_bytes()

    def copy_until_full(source, destination):
        data = Path(source).read_bytes()
        Path(destination).write_bytes(data[: len(data) // 2])
        raise OSError(errno.EFBIG, "File too large", str(destination))

    with monkeypatch.context() as patched:
        patched.setattr(shutil, "copy", copy_until_full)
        with pytest.raises(OSError, match="File too large"):
            nanotron_to_hf(trained, target)
    assert {path.name: path.read_bytes() for path in target.iterdir()} == earlier
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]

    nanotron_to_hf(trained, target)
    assert "note" not in json.loads((target / "config.json").read_text())
    assert (target / "tokenizer.json").read_bytes() == (trained / "1" / "tokenizer" / "tokenizer.json").read_bytes()


def test_an_export_refuses_a_folder_holding_other_files(trained, tmp_path):
    """The export replaces its target folder whole: a folder with anything else in it is refused, untouched."""
    target = tmp_path / "models"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", trained, "--save-path", target)
    assert_user_error(outcome, str(target), "notes.txt", "choose a new or empty folder")
    assert [path.name for path in target.iterdir()] == ["notes.txt"]
