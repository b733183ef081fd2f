"""Configs of the tiny models on the tiny corpus, as dicts a test patches and writes as YAML: the Llama every
test starts from, and the variants of tensor parallelism, the model families, DoReMi and recomputation."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from support.tiers import parity_steps


def tiny_config_dict(tiny_data: dict[str, Path], checkpoint_dir: Path, **overrides) -> dict:
    """A complete config for a ~0.2M-parameter Llama on the tiny corpus; ``overrides`` patch sections."""
    config = {
        "general": {"project": "tests", "run": "tiny", "seed": 7},
        "checkpoints": {"checkpoints_path": str(checkpoint_dir), "checkpoint_interval": 1000},
        "parallelism": {"dp": 1, "pp": 1, "tp": 1},
        "model": {
            "dtype": "float32",
            "init_method": {"std": 0.02},
            "model_config": {
                "is_llama_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "tie_word_embeddings": True,
            },
        },
        "tokenizer": {"tokenizer_name_or_path": str(tiny_data["tokenizer"])},
        "tokens": {"sequence_length": 32, "micro_batch_size": 4, "batch_accumulation_per_replica": 2,
                   "train_steps": 20},
        "optimizer": {
            "weight_decay": 0.01, "clip_grad": 1.0,
            "learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 4, "min_decay_lr": 3e-4},
        },
        "data_stages": [{"name": "main", "start_training_step": 1,
                         "data": {"seed": 3, "num_loading_workers": 0,
                                  "dataset": {"dataset_folder": [str(tiny_data["tokenized"])]}}}],
        "logging": {"iteration_step_info_interval": 1},
    }
    for section, values in overrides.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    return config


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def short_config(tiny_data, run: Path, train_steps: int, **overrides) -> dict:
    """``tiny_config_dict`` for ``train_steps`` steps with one step of warm-up."""
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": train_steps}, **overrides)
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return config


def resume_config(base: dict, run: Path, train_steps: int = 3, model_config: dict | None = None) -> dict:
    """``base``'s config (a trained run and its config: ``{"run", "config"}``) resuming from its run into ``run`` for
    ``train_steps`` steps in all, with ``model_config`` changed."""
    config = copy.deepcopy(base["config"])
    config["model"]["model_config"] |= model_config or {}
    config["checkpoints"] |= {"checkpoints_path": str(run), "resume_checkpoint_path": str(base["run"])}
    config["tokens"]["train_steps"] = train_steps
    return config


def folder_stage(folder: Path, workers: int = 0) -> dict:
    """A data stage from step 1 reading the preprocessed ``folder`` with ``workers`` loading workers."""
    return {"name": "main", "start_training_step": 1,
            "data": {"seed": 3, "num_loading_workers": workers, "dataset": {"dataset_folder": [str(folder)]}}}


def tp_config(tiny_data, tmp_path, name: str, tp: int, mode: str, overlap: bool = False,
              fp32_sums: bool = False) -> dict:
    """8 heads / 4 kv heads so that tp=4 holds whole kv heads; everything splits evenly at tp 4. ``overlap``:
    ``tp_linear_async_communication``, ``fp32_sums``: ``tp_partial_sums_in_fp32``."""
    base = tiny_config_dict(tiny_data, tmp_path / name)
    model = base["model"]
    model["model_config"] = model["model_config"] | {"num_attention_heads": 8, "num_key_value_heads": 4,
                                                     "intermediate_size": 128}
    return tiny_config_dict(tiny_data, tmp_path / name, model=model,
                            parallelism={"tp": tp, "tp_mode": mode, "tp_linear_async_communication": overlap,
                                         "tp_partial_sums_in_fp32": fp32_sums},
                            tokens={"train_steps": parity_steps()})


def grad_norm_config(tiny_data, folder: Path, *, seed: int, tp: int = 1, dtype: str = "bfloat16", fp8: bool = False,
                     tied: bool = True, accumulation: int = 2, mode: str = "REDUCE_SCATTER", lr: float = 3e-3,
                     steps: int = 20, fp32_sums: bool = False) -> dict:
    """The tiny Llama (clip 1.0, 4 warm-up steps) whose grad-norms the layouts are compared on, step by step;
    ``fp32_sums``: ``parallelism.tp_partial_sums_in_fp32``."""
    config = tiny_config_dict(tiny_data, folder, general={"project": "tests", "run": "tiny", "seed": seed},
                              tokens={"train_steps": steps, "batch_accumulation_per_replica": accumulation},
                              parallelism={"tp": tp, "tp_mode": mode, "tp_partial_sums_in_fp32": fp32_sums},
                              fp8={"enabled": fp8})
    config["model"]["dtype"] = dtype
    config["model"]["model_config"]["tie_word_embeddings"] = tied
    config["optimizer"]["learning_rate_scheduler"]["learning_rate"] = lr
    return config


MAMBA = {"is_mamba_config": True, "d_model": 64, "num_hidden_layers": 2, "vocab_size": 384,
         "ssm_cfg": {"d_state": 8, "d_conv": 4, "expand": 2}}


# Layer 0 dense, layers 1-2 mixtures of 4 experts, top-2: a pipeline split [1, 2] leaves stage 0 without experts.
MOE = {"is_llamoe_config": True, "num_hidden_layers": 3, "moe_num_experts": 4, "num_experts_per_tok": 2,
       "moe_first_dense_layers": 1, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001}
MOE_GLOBAL_BATCH = 16


def moe_config(tiny_data, folder: Path, *, dp: int = 1, ep: int = 1, tp: int = 1, pp: int = 1, zero: int = 0,
               resume_from: Path | None = None, **model_changes) -> dict:
    base = tiny_config_dict(tiny_data, folder)
    llama = {k: v for k, v in base["model"]["model_config"].items() if k != "is_llama_config"}
    model = base["model"] | {"model_config": llama | MOE | model_changes}
    parallelism = {"dp": dp, "tp": tp, "pp": pp, "expert_parallel_size": ep, "tp_mode": "REDUCE_SCATTER"}
    if pp > 1:
        parallelism["pp_stage_layers"] = [1, 2]
    steps = parity_steps()  # saved halfway
    return tiny_config_dict(
        tiny_data, folder, model=model, parallelism=parallelism,
        tokens={"train_steps": steps, "micro_batch_size": 4,
                "batch_accumulation_per_replica": MOE_GLOBAL_BATCH // (4 * dp * ep)},
        optimizer=base["optimizer"] | {"zero_stage": zero},
        checkpoints={"checkpoint_interval": steps // 2, "save_final_state": False,
                     "resume_checkpoint_path": None if resume_from is None else str(resume_from)},
    )


DOMAINS = ("animals", "colours", "rivers")
DOREMI_STEPS = 6


def doremi_config(tiny_data, folders, run: Path, *, dp=1, tp=1, pp=1, accumulation=4, reference=None,
                  resume=None, steps=DOREMI_STEPS, **doremi) -> dict:
    config = tiny_config_dict(
        tiny_data, run, parallelism={"dp": dp, "tp": tp, "pp": pp},
        tokens={"train_steps": steps, "micro_batch_size": 8 // (dp * accumulation),
                "batch_accumulation_per_replica": accumulation},
        checkpoints={"checkpoint_interval": 3, "save_final_state": False,
                     "resume_checkpoint_path": None if resume is None else str(resume)},
        data_stages=[{"name": "main", "start_training_step": 1,
                      "data": {"seed": 3, "num_loading_workers": 0,
                               "dataset": {"dataset_folder": [str(f) for f in folders]}}}],
    )
    # A schedule that does not depend on train_steps, so that a run stopped at step 3 resumes onto the same one.
    config["optimizer"]["learning_rate_scheduler"] = {"learning_rate": 3e-3, "lr_warmup_steps": 1,
                                                      "lr_decay_steps": DOREMI_STEPS - 1, "min_decay_lr": 3e-4}
    config["doremi"] = {"step_size": 1.0, "smoothing_param": 1e-3, **doremi}
    if reference is not None:
        config["doremi"]["ref_model_resume_checkpoint_path"] = str(reference)
    return config


RECOMPUTE_STEPS = 6


def recompute_config(tiny_data, folder, recompute: str, **parallelism) -> dict:
    parallelism = tiny_config_dict(tiny_data, folder)["parallelism"] | parallelism | {"recompute": recompute}
    return tiny_config_dict(tiny_data, folder, parallelism=parallelism, tokens={"train_steps": RECOMPUTE_STEPS},
                            checkpoints={"checkpoint_interval": 1000, "save_final_state": False})
