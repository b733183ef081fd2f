"""The YAML config: loading, strictness, legacy keys, validation messages, round trips and derived values; YAML
alias bombs refused at once."""

from __future__ import annotations

import copy
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import MISSING, fields, is_dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from nanotron.config import (
    Config,
    ConfigError,
    DatasetStageArgs,
    DuplicateKeyWarning,
    ExistingCheckpointInit,
    LegacyKeyWarning,
    RandomInit,
    config_from_dict,
    config_to_dict,
    expand_run_name,
    load_config,
    save_config,
    validate_config,
)
from support.runs import assert_user_error, cli, python_process

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "config_tiny_llama.yaml"

# Every field of the schema, each set to a value other than its default where another value is valid.
FULL: dict[str, Any] = {
    "general": {"project": "full", "run": "full_%date", "seed": 7},
    "checkpoints": {
        "checkpoints_path": "ckpt/full",
        "checkpoint_interval": 5,
        "save_initial_state": True,
        "save_final_state": False,
        "resume_checkpoint_path": "ckpt/full",
        "checkpoints_path_is_shared_file_system": True,
        "keep_last_n": 2,
        "load_optimizer": False,
        "load_lr_scheduler": False,
        "allow_tokenizer_change": True,
        "async_save": True,
    },
    "parallelism": {
        "dp": 2,
        "pp": 2,
        "tp": 2,
        "expert_parallel_size": 2,
        "context_parallel_size": 1,
        "dp_shard": 2,
        "pp_engine": "afab",
        "virtual_pipeline_size": 1,
        "tp_mode": "REDUCE_SCATTER",
        "tp_linear_async_communication": True,
        "tp_partial_sums_in_fp32": False,
        "pp_stage_layers": [1, 3],
        "pp_timeout_s": 30.0,
        "replica_check_interval": 7,
        "recompute": "selective",
    },
    "model": {
        "model_config": {  # the mixture-of-experts family: every Llama field plus the MoE ones
            "is_llama_config": False,
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "tie_word_embeddings": True,
            "attention_bias": True,
            "hidden_act": "gelu",
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 3,
            "initializer_range": 0.01,
            "is_llamoe_config": True,
            "moe_num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_capacity_factor": 1.25,
            "moe_aux_loss_coef": 0.02,
            "moe_z_loss_coef": 0.001,
            "moe_normalize_topk": False,
            "moe_first_dense_layers": 1,
        },
        "init_method": {"path": "ckpt/pretrained"},
        "dtype": "float16",
        "make_vocab_size_divisible_by": 64,
        "ddp_bucket_cap_mb": 50,
        "compile": True,
        "loss_chunk_tokens": 2048,
        "attention_backend": "torch",
    },
    "tokenizer": {"tokenizer_name_or_path": "gpt2", "tokenizer_revision": "main"},
    "optimizer": {
        "learning_rate_scheduler": {
            "learning_rate": 6e-4,
            "lr_warmup_steps": 10,
            "lr_warmup_style": "constant",
            "lr_decay_style": "1-sqrt",
            "lr_decay_starting_step": 80,
            "lr_decay_steps": 20,
            "min_decay_lr": 6e-5,
        },
        "zero_stage": 2,
        "weight_decay": 0.1,
        "weight_decay_exclude_named_params": [r".*norm.*", r".*\.bias$"],
        "clip_grad": None,
        "accumulate_grad_in_fp32": False,
        "adam_eps": 1e-6,
        "adam_beta1": 0.8,
        "adam_beta2": 0.99,
        "adam_moments_dtype": "bfloat16",
        "store_param_remainders": False,
        "persistent_gradient_buffers": True,
        "grad_reduce_in_bf16": True,
        "torch_adam_is_fused": False,
        "skip_bad_steps": 2,
        "loss_spike_factor": 3.0,
        "name": "muon",
        "muon_momentum": 0.9,
        "muon_nesterov": False,
        "muon_ns_steps": 6,
        "muon_ns_coefficients": [3.0, -3.2, 1.2],
        "muon_update_scale": "original",
        "muon_weight_decay": 0.05,
        "muon_named_params": [r"^layers\..*_proj\.weight$"],
        "muon_qk_clip_threshold": 100.0,
    },
    "tokens": {"sequence_length": 128, "train_steps": 100, "micro_batch_size": 2, "batch_accumulation_per_replica": 4},
    "data_stages": [
        {
            "name": "general",
            "start_training_step": 1,
            "data": {
                "dataset": {"dataset_folder": ["data/web", "data/code"], "dataset_weights": [0.7, 0.3],
                            "token_size_in_bytes": 4, "tokenizer_name": "gpt2", "vocab_size": 500,
                            "return_positions": False},
                "seed": 3,
                "num_loading_workers": 0,
            },
        },
        {
            "name": "anneal",
            "start_training_step": 80,
            "data": {
                "dataset": {"hf_dataset_or_datasets": {"data/curated": 1.0}, "hf_dataset_splits": ["train", "extra"],
                            "hf_dataset_config_name": "en", "dataset_processing_num_proc_per_process": 2,
                            "dataset_overwrite_cache": True, "text_column_name": "content"},
                "seed": 4,
                "num_loading_workers": 2,
            },
        },
        {"name": "throughput", "start_training_step": 90,
         "data": {"dataset": None, "seed": 5, "num_loading_workers": 3}},
    ],
    "logging": {
        "log_level": "warning",
        "log_level_replica": "error",
        "iteration_step_info_interval": 5,
        "metrics_path": "logs/metrics.jsonl",
        "tensorboard_dir": "logs/tensorboard",
        "wandb": {"project": "full", "entity": "lab", "mode": "offline", "name": "full-run", "dir": "logs/wandb"},
    },
    "profiler": {"profiler_export_path": "profiles"},
    "doremi": {"domain_names": None, "domain_weights": None, "ref_model_resume_checkpoint_path": "ckpt/reference",
               "step_size": 0.5, "smoothing_param": 0.01},
    "fp8": {"enabled": True, "recipe": "rowwise", "amax_history_length": 8, "gradient_format": "e4m3",
            "exclude_modules": ["o_proj$"], "log_out_of_range": True},
    "evals": {"eval_interval": 50, "tasks": [{"path": "evals/arc", "name": "arc", "num_fewshot": 5, "fewshot_seed": 7,
                                              "max_samples": 100, "max_tokens": 100000, "target_delimiter": ":",
                                              "fewshot_delimiter": "\n"}],
              "held_out": ["data/valid"], "held_out_max_windows": 16},
}
# Fields with a single valid value, which FULL therefore leaves at the default.
SINGLE_VALUED = {"is_llama_config", "is_llamoe_config", "checkpoints_path_is_shared_file_system"}


def example_dict() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def problems_after(mutate: Callable[[dict], None], world_size: int | None = None) -> list[str]:
    """The problems reported for the example config after `mutate` edits its plain-data form."""
    d = example_dict()
    mutate(d)
    with pytest.raises(ConfigError) as info:
        validate_config(config_from_dict(d), world_size)
    return info.value.problems


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


# --- the example and round trips ---------------------------------------------------------------------------------


def test_example_loads_with_the_quickstart_values():
    cfg = load_config(EXAMPLE)
    llama = cfg.model.model_config
    assert (llama.vocab_size, llama.hidden_size, llama.intermediate_size) == (4096, 128, 384)
    assert (llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads) == (4, 4, 2)
    assert llama.max_position_embeddings == 256 and llama.tie_word_embeddings and llama.head_dim == 32
    assert cfg.model.init_method == RandomInit(std=0.02)
    assert cfg.model.torch_dtype() is torch.float32
    assert cfg.optimizer.learning_rate_scheduler.learning_rate == 3e-3
    assert cfg.optimizer.learning_rate_scheduler.min_decay_lr == 3e-4
    assert cfg.data_stages[0].data.dataset.dataset_folder == [Path("work/data/tokenized")]
    assert cfg.checkpoints.checkpoints_path == Path("checkpoints/tiny_llama")
    assert cfg.parallelism.world_size == 1
    assert (cfg.global_batch_size, cfg.global_batch_tokens) == (16, 16 * 128)


@pytest.mark.parametrize("name", ["example", "full", "moe"])
def test_save_then_load_gives_an_equal_config(tmp_path, name):
    cfg = {"example": lambda: load_config(EXAMPLE), "full": lambda: config_from_dict(FULL),
           "moe": lambda: load_config(EXAMPLE.with_name("config_tiny_moe.yaml"))}[name]()
    save_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(tmp_path / "out" / "config.yaml") == cfg
    if name == "moe":
        assert type(cfg.model.model_config).__name__ == "LlaMoEConfig" and cfg.global_batch_size == 16


def test_full_config_reads_and_writes_every_field():
    assert config_to_dict(config_from_dict(FULL)) == FULL


def _defaulted_fields(obj: Any, key: str = "") -> Iterator[tuple[str, Any, Any]]:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list) and value and is_dataclass(value[0]):
            for item in value:
                yield from _defaulted_fields(item, f"{key}{f.name}[].")
        elif is_dataclass(value):
            yield from _defaulted_fields(value, f"{key}{f.name}.")
        elif f.default is not MISSING:
            yield key + f.name, value, f.default


def test_full_config_sets_every_optional_field_to_a_non_default_value():
    left_at_default = [
        key
        for key, value, default in _defaulted_fields(config_from_dict(FULL))
        if value == default and key.rsplit(".", 1)[-1] not in SINGLE_VALUED
    ]
    # The DoReMi domain lists need one entry per folder of every stage, and these stages have 2, 1 and 1 domains;
    # context parallelism composes neither with DoReMi nor with the experts' capacity this config sets, model chunks
    # (virtual pipeline stages) not with the ZeRO-2 it sets, TP sums in fp32 not with its FP8 linears.
    assert left_at_default == ["parallelism.context_parallel_size", "parallelism.virtual_pipeline_size",
                               "parallelism.tp_partial_sums_in_fp32", "doremi.domain_names", "doremi.domain_weights"]


def test_saved_yaml_lists_sections_in_schema_order(tmp_path):
    save_config(config_from_dict(FULL), tmp_path / "config.yaml")
    sections = list(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert sections == [f.name for f in fields(Config)]


def test_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text("previous")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_config(load_config(EXAMPLE), path)
    assert path.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_loading_does_not_modify_its_input():
    d = copy.deepcopy(FULL)
    config_from_dict(d)
    assert d == FULL


# --- normalisation and defaults ----------------------------------------------------------------------------------


def test_spellings_are_normalised_and_derived_defaults_filled():
    d = example_dict()
    d["parallelism"].update(pp_engine="AFAB", tp_mode="reduce_scatter")
    d["model"]["dtype"] = "bf16"
    d["model"]["model_config"]["num_key_value_heads"] = None
    cfg = config_from_dict(d)
    assert (cfg.parallelism.pp_engine, cfg.parallelism.tp_mode) == ("afab", "REDUCE_SCATTER")
    assert cfg.model.dtype == "bfloat16" and cfg.model.torch_dtype() is torch.bfloat16
    assert cfg.model.model_config.num_key_value_heads == 4


def test_optional_sections_take_defaults_and_profiler_may_be_null():
    d = example_dict()
    del d["parallelism"], d["logging"]
    d["profiler"] = None
    cfg = config_from_dict(d)
    assert cfg.parallelism.world_size == 1 and cfg.parallelism.pp_engine == "1f1b"
    assert cfg.logging.iteration_step_info_interval == 1
    assert cfg.profiler is None


def test_init_method_form_selects_the_class():
    d = example_dict()
    d["model"]["init_method"] = {"path": "ckpt/step_100"}
    assert config_from_dict(d).model.init_method == ExistingCheckpointInit(path=Path("ckpt/step_100"))


def test_dataset_folder_accepts_a_list():
    d = example_dict()
    d["data_stages"][0]["data"]["dataset"].update(dataset_folder=["a", "b"], dataset_weights=[1, 3])
    dataset = config_from_dict(d).data_stages[0].data.dataset
    assert dataset.dataset_folder == [Path("a"), Path("b")]
    assert dataset.dataset_weights == [1.0, 3.0]


def test_metrics_path_defaults_to_the_checkpoint_folder():
    cfg = load_config(EXAMPLE)
    assert cfg.resolved_metrics_path() == Path("checkpoints/tiny_llama/metrics.jsonl")
    assert config_from_dict(FULL).resolved_metrics_path() == Path("logs/metrics.jsonl")


# --- strictness ---------------------------------------------------------------------------------------------------


def test_unknown_key_names_the_dotted_key_and_the_closest_name():
    d = example_dict()
    d["optimizer"]["learning_rate_schedular"] = d["optimizer"].pop("learning_rate_scheduler")
    with pytest.raises(ConfigError) as info:
        config_from_dict(d)
    assert info.value.problems == [
        "unknown key 'optimizer.learning_rate_schedular'; did you mean 'learning_rate_scheduler'?",
        "missing required key 'optimizer.learning_rate_scheduler'; add it (see docs/config.md)",
    ]


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    d = example_dict()
    d["logging"]["slack"] = True
    with pytest.raises(ConfigError, match=r"unknown key 'logging.slack'; valid keys are: log_level, "):
        config_from_dict(d)


def test_unknown_section_is_suggested():
    d = example_dict()
    d["optimiser"] = d.pop("optimizer")
    with pytest.raises(ConfigError, match=r"unknown key 'optimiser'; did you mean 'optimizer'\?"):
        config_from_dict(d)


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("checkpoints", "save_final_state", 1, "checkpoints.save_final_state: expected a boolean (true/false), got 1"),
        ("tokens", "train_steps", "300", "tokens.train_steps: expected an integer, got '300' (str)"),
        ("tokens", "train_steps", True, "tokens.train_steps: expected an integer, got True (bool)"),
        ("tokens", "micro_batch_size", 16.0, "tokens.micro_batch_size: expected an integer, got 16.0 (float)"),
        ("general", "project", None, "general.project: expected a string, got null"),
        ("logging", "metrics_path", 3, "logging.metrics_path: expected a path or null, got 3 (int)"),
        ("checkpoints", "keep_last_n", "all", "checkpoints.keep_last_n: expected an integer or null, got 'all'"),
    ],
)
def test_wrong_type_names_the_key_the_expected_type_and_the_value(section, key, value, expected):
    d = example_dict()
    d[section][key] = value
    with pytest.raises(ConfigError) as info:
        config_from_dict(d)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(expected)


def test_wrong_type_inside_a_list_names_the_item():
    d = example_dict()
    d["data_stages"][0]["data"]["dataset"]["dataset_folder"] = ["ok", 7]
    with pytest.raises(ConfigError, match=r"data_stages\[0\]\.data\.dataset\.dataset_folder\[1\]: expected a path"):
        config_from_dict(d)


def test_a_float_written_1e_minus_3_is_accepted(tmp_path):
    text = EXAMPLE.read_text().replace("learning_rate: 3.0e-3", "learning_rate: 1e-3")
    assert yaml.safe_load(text)["optimizer"]["learning_rate_scheduler"]["learning_rate"] == "1e-3"  # YAML 1.1
    lr = load_config(write(tmp_path, text)).optimizer.learning_rate_scheduler.learning_rate
    assert lr == 1e-3 and isinstance(lr, float)


@pytest.mark.parametrize("value", ["fast", float("nan"), "nan"])
def test_a_value_that_is_not_a_number_is_rejected_for_a_float(value):
    d = example_dict()
    d["optimizer"]["learning_rate_scheduler"]["learning_rate"] = value
    with pytest.raises(ConfigError, match=r"learning_rate: expected a number, got"):
        config_from_dict(d)


def test_every_loading_problem_is_reported_at_once():
    d = example_dict()
    d["tokens"]["train_steps"] = "300"
    d["general"]["seeed"] = 1
    del d["checkpoints"]
    with pytest.raises(ConfigError) as info:
        config_from_dict(d)
    assert len(info.value.problems) == 3
    assert str(info.value).startswith("3 problems:\n  - ")


def test_missing_section_is_named():
    d = example_dict()
    del d["tokens"]
    with pytest.raises(ConfigError, match=r"missing required section 'tokens'"):
        config_from_dict(d)


def test_model_config_without_a_marker_lists_the_supported_markers():
    d = example_dict()
    d["model"]["model_config"]["is_llama_config"] = False
    with pytest.raises(ConfigError, match=r"model\.model_config: .*one of 'is_llama_config: true', "
                                          r"'is_llamoe_config: true', 'is_mamba_config: true', "
                                          r"'is_qwen2_config: true', 'is_qwen3_config: true', "
                                          r"'is_deepseek_v3_config: true' \(found none\)"):
        config_from_dict(d)


def test_init_method_with_both_forms_is_rejected():
    d = example_dict()
    d["model"]["init_method"] = {"std": 0.02, "path": "ckpt"}
    with pytest.raises(ConfigError, match=r"model\.init_method: expected \{std: <a number>\} or \{path: <a path>\}"):
        config_from_dict(d)


# --- legacy keys and sections --------------------------------------------------------------------------------------


def test_legacy_keys_are_ignored_with_one_warning_naming_them_all():
    d = example_dict()
    d["general"].update(step=None, consumed_train_samples=None, benchmark_csv_path=None, ignore_sanity_checks=True)
    d["tokens"].update(val_check_interval=-1, limit_val_batches=0, limit_test_batches=0)
    d["lighteval"] = {"batch_size": 8}
    with pytest.warns(LegacyKeyWarning) as record:
        cfg = config_from_dict(d)
    (warning,) = record
    named = re.findall(r"'([\w.]+)' \(", str(warning.message))
    assert sorted(named) == [
        "general.benchmark_csv_path",
        "general.consumed_train_samples",
        "general.ignore_sanity_checks",
        "general.step",
        "lighteval",
        "tokens.limit_test_batches",
        "tokens.limit_val_batches",
        "tokens.val_check_interval",
    ]
    assert cfg == load_config(EXAMPLE)


def test_the_v04_data_section_is_one_stage_from_step_1():
    d = example_dict()
    stage = d.pop("data_stages")[0]
    d["data"] = stage["data"]
    cfg = config_from_dict(d)
    assert [(s.start_training_step, s.data) for s in cfg.data_stages] == [(1, load_config(EXAMPLE).data_stages[0].data)]


# --- files --------------------------------------------------------------------------------------------------------


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "general:\n  project: x\n  run: [unclosed\ntokens: {}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: line \d+, column \d+: invalid YAML"):
        load_config(path)


def test_duplicate_keys_warn_and_the_last_one_wins(tmp_path):
    text = EXAMPLE.read_text()
    path = write(tmp_path, text.replace("general:\n", "general:\n  project: first\n", 1))
    with pytest.warns(DuplicateKeyWarning, match=r"line \d+: the key 'project' is written more than once"):
        cfg = load_config(path)
    assert cfg.general.project == load_config(EXAMPLE).general.project


def test_problems_in_a_file_name_the_file(tmp_path):
    path = write(tmp_path, EXAMPLE.read_text().replace("checkpoint_interval: 100", "checkpoint_interval: 0"))
    with pytest.raises(ConfigError, match=rf"^{path}: checkpoints.checkpoint_interval must be >= 1 \(got 0\)$"):
        load_config(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope\.yaml' does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- validation rules ---------------------------------------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation that sets the dotted `path` (list items by index) of the plain config."""

    def mutate(d: dict) -> None:
        *parents, last = path.split(".")
        for name in parents:
            d = d[int(name)] if isinstance(d, list) else d[name]
        d[last] = value

    return mutate


def _all(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        for m in mutations:
            m(d)

    return mutate


MC = "model.model_config"
LR = "optimizer.learning_rate_scheduler"
STAGE = "data_stages.0"

RULES = {
    "counts are positive": (_set("tokens.micro_batch_size", 0), ["tokens.micro_batch_size must be >= 1"]),
    "checkpoint interval is positive": (
        _set("checkpoints.checkpoint_interval", 0),
        ["checkpoints.checkpoint_interval must be >= 1"],
    ),
    "keep_last_n is at least 1": (_set("checkpoints.keep_last_n", 0), ["checkpoints.keep_last_n must be >= 1"]),
    "parallel degrees are positive": (_set("parallelism.dp", 0), ["parallelism.dp must be >= 1"]),
    "hidden size splits into heads": (
        _set(f"{MC}.hidden_size", 130),
        [f"{MC}.hidden_size (130)", f"{MC}.num_attention_heads (4)"],
    ),
    "heads split into kv groups": (
        _set(f"{MC}.num_key_value_heads", 3),
        [f"{MC}.num_attention_heads (4)", f"{MC}.num_key_value_heads (3)"],
    ),
    "kv heads split over tp": (
        _set("parallelism.tp", 3),
        [f"{MC}.num_key_value_heads (2)", "parallelism.tp (3)"],
    ),
    "intermediate size splits over tp": (
        _all(_set(f"{MC}.intermediate_size", 385), _set("parallelism.tp", 2)),
        [f"{MC}.intermediate_size (385)", "parallelism.tp (2)"],
    ),
    "reduce-scatter splits the sequence over tp": (
        _all(
            _set("parallelism.tp", 2),
            _set("parallelism.tp_mode", "REDUCE_SCATTER"),
            _set("tokens.sequence_length", 127),
        ),
        ["tokens.sequence_length (127)", "parallelism.tp (2)", "REDUCE_SCATTER"],
    ),
    "async tp needs reduce-scatter": (
        _set("parallelism.tp_linear_async_communication", True),
        ["parallelism.tp_linear_async_communication", "parallelism.tp_mode: REDUCE_SCATTER"],
    ),
    "spectral µP is AdamW's": (
        _all(_set("model.init_method", {"use_mup": True}), _set("optimizer.name", "muon")),
        ["model.init_method.use_mup: true", "optimizer.name: muon", "keep one of them"],
    ),
    "TP sums in fp32 are not FP8's": (
        _all(_set("parallelism.tp_partial_sums_in_fp32", True), _set("fp8", {"enabled": True})),
        ["parallelism.tp_partial_sums_in_fp32: true", "fp8.enabled", "disable one of them"],
    ),
    "every pipeline stage gets a layer": (
        _set("parallelism.pp", 8),
        [f"{MC}.num_hidden_layers (4)", "parallelism.pp x virtual_pipeline_size (8 x 1)"],
    ),
    "pp engine is known": (_set("parallelism.pp_engine", "looped_bfs"),
                           ["parallelism.pp_engine must be one of afab, 1f1b, interleaved_1f1b, zb_h1, zbv"]),
    "tp mode is known": (_set("parallelism.tp_mode", "ring"), ["parallelism.tp_mode must be one of ALL_REDUCE"]),
    "dtype is known": (_set("model.dtype", "float8"), ["model.dtype must be one of float32, bfloat16, float16, fp32"]),
    "init std is positive": (_set("model.init_method", {"std": 0.0}), ["model.init_method.std must be > 0"]),
    "zero stage is 0 to 3": (_set("optimizer.zero_stage", 4), ["optimizer.zero_stage must be 0", "(got 4)"]),
    "ZeRO-2 and 3 run one model chunk per stage": (
        _all(_set("optimizer.zero_stage", 2), _set("parallelism.dp", 2), _set("parallelism.pp", 2),
             _set("parallelism.pp_engine", "zb_h1")),
        ["optimizer.zero_stage 2 runs with parallelism.pp_engine afab or 1f1b, not zb_h1"],
    ),
    "sequence fits the position embeddings under RoPE scaling": (
        _all(_set("tokens.sequence_length", 512), _set(f"{MC}.rope_scaling", {"rope_type": "linear", "factor": 2.0})),
        ["tokens.sequence_length (512)", f"{MC}.max_position_embeddings (256)", "raise max_position_embeddings"],
    ),
    "rope is not interleaved": (_set(f"{MC}.rope_interleaved", True),
                                [f"{MC}.rope_interleaved (true): the interleaved rotary layout is not available"]),
    "rope scaling names its type": (
        _set(f"{MC}.rope_scaling", {"factor": 2.0}),
        [f"{MC}.rope_scaling.rope_type must be one of linear, llama3", "null for plain RoPE"],
    ),
    "rope scaling has its type's keys": (
        _set(f"{MC}.rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
        [f"{MC}.rope_scaling misses low_freq_factor", "rope_type llama3 takes exactly the keys"],
    ),
    "activation is one the MLP builds": (_set(f"{MC}.hidden_act", "gelu_new"),
                                         [f"{MC}.hidden_act must be one of silu, gelu, gelu_pytorch_tanh, relu"]),
    "pretraining_tp is 1": (_set(f"{MC}.pretraining_tp", 2), [f"{MC}.pretraining_tp (2)", "parallelism.tp"]),
    "token ids fit the vocabulary": (_set(f"{MC}.eos_token_id", 4096), [f"{MC}.eos_token_id (4096)", "vocab_size"]),
    "learning rate is positive": (
        _all(_set(f"{LR}.learning_rate", 0.0), _set(f"{LR}.min_decay_lr", 0.0)),
        [f"{LR}.learning_rate must be > 0"],
    ),
    "warmup style is known": (_set(f"{LR}.lr_warmup_style", "cosine"), [f"{LR}.lr_warmup_style must be one of"]),
    "decay style is known": (_set(f"{LR}.lr_decay_style", "exp"), [f"{LR}.lr_decay_style must be one of"]),
    "decay starts after warmup": (
        _set(f"{LR}.lr_decay_starting_step", 10),
        [f"{LR}.lr_decay_starting_step (10)", f"{LR}.lr_warmup_steps (30)"],
    ),
    "decay length is non-negative": (_set(f"{LR}.lr_decay_steps", -1), [f"{LR}.lr_decay_steps must be >= 0"]),
    "default decay length is non-negative": (
        _set(f"{LR}.lr_decay_starting_step", 700),
        [f"{LR}.lr_decay_starting_step (700)", "tokens.train_steps (600)", f"set {LR}.lr_decay_steps"],
    ),
    "min lr is at most the lr": (_set(f"{LR}.min_decay_lr", 1.0), [f"{LR}.min_decay_lr (1.0)"]),
    "adam betas are below 1": (_set("optimizer.adam_beta2", 1.0), ["optimizer.adam_beta2 must be in [0, 1)"]),
    "weight decay exclusions are regexes": (
        _set("optimizer.weight_decay_exclude_named_params", ["(norm"]),
        ["optimizer.weight_decay_exclude_named_params[0] ('(norm') is not a valid regex"],
    ),
    "there is a data stage": (_set("data_stages", []), ["data_stages must list at least one stage"]),
    "stage names are unique": (
        lambda d: d["data_stages"].append({**copy.deepcopy(d["data_stages"][0]), "start_training_step": 50}),
        ["data_stages: the name 'main' is used by more than one stage"],
    ),
    "stage starts are unique": (
        lambda d: d["data_stages"].append({**copy.deepcopy(d["data_stages"][0]), "name": "second"}),
        ["data_stages: more than one stage has start_training_step 1"],
    ),
    "a stage starts at step 1": (
        _set(f"{STAGE}.start_training_step", 2),
        ["data_stages: one stage must have start_training_step: 1"],
    ),
    "stages start at a training step": (
        lambda d: d["data_stages"].append(
            {**copy.deepcopy(d["data_stages"][0]), "name": "late", "start_training_step": 0}
        ),
        ["data_stages['late'].start_training_step (0) must be >= 1"],
    ),
    "one weight per folder": (
        _set(f"{STAGE}.data.dataset.dataset_weights", [0.5, 0.5]),
        ["data_stages['main'].data.dataset.dataset_weights has 2 entries but dataset_folder has 1"],
    ),
    "weights are positive": (
        _set(f"{STAGE}.data.dataset.dataset_weights", [0]),
        ["data_stages['main'].data.dataset.dataset_weights[0] must be > 0"],
    ),
    "loading workers are non-negative": (
        _set(f"{STAGE}.data.num_loading_workers", -1),
        ["data_stages['main'].data.num_loading_workers must be >= 0"],
    ),
    "log level is known": (_set("logging.log_level", "verbose"), ["logging.log_level must be one of debug, info"]),
    "fp8 history has a step": (_set("fp8", {"enabled": True, "recipe": "delayed", "amax_history_length": 0}),
                               ["fp8.amax_history_length must be at least 1, got 0"]),
    "muon takes at least one newton-schulz step": (
        _all(_set("optimizer.name", "muon"), _set("optimizer.muon_ns_steps", 0)),
        ["optimizer.muon_ns_steps must be >= 1"],
    ),
    "muon settings need muon": (
        _set("optimizer.muon_momentum", 0.9),
        ["optimizer.muon_momentum is a setting of Muon but optimizer.name is adamw", "optimizer.name: muon"],
    ),
    "log interval is positive": (
        _set("logging.iteration_step_info_interval", 0),
        ["logging.iteration_step_info_interval must be >= 1"],
    ),
    "evals have something to score": (_set("evals", {"eval_interval": 10}), ["evals has no tasks and no held_out"]),
    "eval interval is positive": (_set("evals", {"eval_interval": 0, "held_out": ["valid"]}),
                                  ["evals.eval_interval must be >= 1"]),
    "eval tasks have distinct names": (
        _set("evals", {"tasks": [{"path": "a/arc.jsonl"}, {"path": "b/arc.parquet"}]}),
        ["evals.tasks: two tasks are named 'arc'"],
    ),
    "eval budgets are positive": (_set("evals", {"tasks": [{"path": "arc", "max_tokens": 0}]}),
                                  ["evals.tasks[0].max_tokens must be >= 1"]),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_each_validation_rule_reports_one_problem_naming_its_keys(rule):
    mutate, expected = RULES[rule]
    problems = problems_after(mutate)
    assert len(problems) == 1, problems
    for text in expected:
        assert text in problems[0]


def test_all_validation_problems_are_reported_together():
    problems = problems_after(_all(_set("optimizer.zero_stage", 4), _set("parallelism.pp", 8), _set("data_stages", [])))
    assert len(problems) == 3


def test_world_size_must_match_the_launch():
    cfg = config_from_dict(FULL)
    validate_config(cfg, world_size=16)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=8)
    (problem,) = info.value.problems
    for text in (
        "parallelism.dp (2)",
        "parallelism.pp (2)",
        "parallelism.tp (2)",
        "parallelism.expert_parallel_size (2)",
    ):
        assert text in problem
    assert "= 16, but 8 processes" in problem and "torchrun --nproc_per_node" in problem


# --- derived values -----------------------------------------------------------------------------------------------


def test_data_stage_at_picks_the_latest_started_stage():
    d = example_dict()
    main = d["data_stages"][0]
    d["data_stages"] = [  # written out of order on purpose: stored sorted
        {**copy.deepcopy(main), "name": "anneal", "start_training_step": 250},
        main,
        {**copy.deepcopy(main), "name": "code", "start_training_step": 100},
    ]
    cfg = config_from_dict(d)
    assert [stage.name for stage in cfg.data_stages] == ["main", "code", "anneal"]
    names = {step: cfg.data_stage_at(step).name for step in (1, 99, 100, 249, 250, 300)}
    assert names == {1: "main", 99: "main", 100: "code", 249: "code", 250: "anneal", 300: "anneal"}
    assert isinstance(cfg.data_stage_at(1), DatasetStageArgs)
    with pytest.raises(ValueError, match="step 0"):
        cfg.data_stage_at(0)


def test_global_batch_counts_data_and_expert_parallel_ranks():
    cfg = config_from_dict(FULL)  # mbs 2, accumulation 4, dp 2, ep 2 (pp and tp do not multiply the batch)
    assert cfg.global_batch_size == 2 * 4 * 2 * 2
    assert cfg.global_batch_tokens == 32 * 128
    assert cfg.parallelism.world_size == 16


def test_expand_run_name_fills_the_placeholders_in_a_copy(monkeypatch):
    cfg = load_config(EXAMPLE)
    now = datetime(2024, 1, 2, 3, 4, 5)
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert expand_run_name(cfg, now).general.run == "tiny_llama_20240102_030405_1234"
    assert cfg.general.run == "tiny_llama_%date_%jobid"
    monkeypatch.delenv("SLURM_JOB_ID")
    d = example_dict()
    del d["general"]["run"]
    assert expand_run_name(config_from_dict(d), now).general.run == "20240102_030405_local"


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    save_config(cfg, tmp_path / "again.yaml")
    assert load_config(tmp_path / "again.yaml") == cfg


# --- YAML alias bombs -----------------------------------------------------------------------------------------------

def _nested_aliases(levels: int) -> str:
    """A flow list of ``levels`` anchored lists, each holding the previous one 9 times: 9**levels values."""
    lists = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    lists += [f"&l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]" for level in range(1, levels)]
    return "[" + ", ".join(lists) + "]"


@pytest.mark.parametrize("document, key", [
    ("general:\n  project: {laughs}\n", "general.project[5]"),
    pytest.param("data_stages: {laughs}\n", "data_stages[5]", marks=pytest.mark.slow),
], ids=["general.project", "data_stages"])
@pytest.mark.slow
def test_nested_yaml_aliases_are_refused_at_once(tmp_path, document, key):
    import nanotron.trainer  # noqa: F401  (imported by the command before it reads the config: not timed)

    config = tmp_path / "laughs.yaml"
    config.write_text(document.format(laughs=_nested_aliases(7)))  # 9**7 = 4.8M values from 300 bytes
    fragments = (str(config), f"'{key}' holds more than 100,000 values once its YAML aliases", "write the values out")
    start = time.perf_counter()
    outcome = cli("train", "--config-file", config)
    assert time.perf_counter() - start < 0.5
    assert_user_error(outcome, *fragments)
    assert_user_error(python_process("run_train.py", "--config-file", config), *fragments)


def test_an_alias_of_its_own_container_is_refused(tmp_path):
    config = tmp_path / "loop.yaml"
    config.write_text("general: &g\n  project: *g\n")
    assert_user_error(cli("train", "--config-file", config), str(config), "'general.project' is an alias of a value "
                                                                          "that contains it")
