"""The systems ``scripts/benchmark.py`` trains beside nanotron: what a user would train the same model with instead.

Each peer is built as a ``TrainingLoop`` on one device at the preset's shape (a nanotron model-config dict) and
trained on nanotron's own batches, the micro-batch losses averaged, gradients clipped at 1.0:

- ``hf``: the ``transformers`` model in bf16 with fused AdamW, each decoder layer and the loss compiled (as
  nanotron's ``model.compile``); ``hf-eager``: the same loop eagerly; ``hf-amp``: the compiled loop with fp32
  weights and optimizer state under bf16 autocast (as ``transformers``' Trainer trains with ``bf16=True``); with a
  torchao recipe, its decoder layers' linears in torchao's float8 training (the LM head stays bf16, as nanotron's
  FP8 keeps it).
- ``liger``: that model with Liger's kernels (RoPE, RMSNorm, SwiGLU, the fused linear cross-entropy that never
  builds the logits), eager, as Liger is used (compiled it is slower: its kernels break the graphs).
- ``torchtitan``: torchtitan's own model of the family at the preset's shape (``llama3``, ``llama4`` as Mixtral,
  ``qwen3`` dense and MoE, ``deepseek_v3``), its ``parallelize_*`` (each block compiled, no activation
  checkpointing), its loss and AdamW (with its expert-bias balancing for the MoEs), fp32 parameters under bf16
  autocast as it trains on one GPU.
- ``mamba-ssm``: the authors' Mamba with its CUDA kernels (Mamba presets).

``peer_problem`` says, before anything is allocated, why a peer cannot run (another model family, a library that
does not import).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from benchmark_record import BackwardStart, tensor_bytes

# --peer name -> the system's name in the record.
PEERS = {"hf": "hf-compiled", "hf-eager": "hf-eager", "hf-amp": "hf-amp", "liger": "liger", "torchtitan": "torchtitan",
         "mamba-ssm": "mamba-ssm"}
# What each peer imports, and how to get it.
REQUIREMENTS = {
    "hf": (("transformers",), "transformers (pip install -e '.[hf]')"),
    "hf-eager": (("transformers",), "transformers (pip install -e '.[hf]')"),
    "hf-amp": (("transformers",), "transformers (pip install -e '.[hf]')"),
    "liger": (("transformers", "liger_kernel.transformers"),
              "liger-kernel 0.8.5 (scripts/install_peers.sh from wheels, or pip install -e '.[bench]')"),
    "torchtitan": (("torchtitan.models.llama3", "torchtitan.models.llama4", "torchtitan.models.qwen3",
                    "torchtitan.models.deepseek_v3"),
                   "torchtitan 0.2.2 and what it imports "
                   "(scripts/install_peers.sh from wheels, or pip install -e '.[bench]')"),
    "mamba-ssm": (("mamba_ssm.models.mixer_seq_simple",), "mamba-ssm and causal-conv1d (built for the GPU)"),
    "torchao": (("transformers", "torchao.float8"), "torchao (pip install torchao)"),
}
# The libraries whose versions a record keeps.
LIBRARIES = ("transformers", "liger-kernel", "torchtitan", "torchao", "mamba-ssm", "triton", "flash-attn-4")
# nanotron config keys -> transformers config keys where they differ; the markers have no counterpart.
HF_NAMES = {"moe_num_experts": "num_local_experts", "is_llama_config": None, "is_llamoe_config": None,
            "is_qwen3_config": None, "is_deepseek_v3_config": None}
# Each family's transformers module (``transformers.models.<family>``) and class prefix.
HF_CLASSES = {"llama": "Llama", "mixtral": "Mixtral", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
              "deepseek_v3": "DeepseekV3"}
# The families each peer trains.
FAMILIES = {"torchtitan": ("llama", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3"), "mamba-ssm": ("mamba",)}


def family(preset: dict) -> str:
    """The preset's family, named as its ``transformers`` module."""
    if preset.get("is_mamba_config"):
        return "mamba"
    if preset.get("is_deepseek_v3_config"):
        return "deepseek_v3"
    if preset.get("is_qwen3_config"):
        return "qwen3_moe" if preset.get("moe_config") else "qwen3"
    return "mixtral" if preset.get("is_llamoe_config") else "llama"


def peer_problem(peer: str, preset_name: str, preset: dict) -> str | None:
    """Why ``peer`` cannot train ``preset`` here (its family, or its library does not import), else None."""
    kind = family(preset)
    if kind not in FAMILIES.get(peer, tuple(HF_CLASSES)):
        trained = ", ".join(FAMILIES.get(peer, tuple(HF_CLASSES)))
        hint = "use --peer mamba-ssm (the authors' kernels) or --no-peers" if kind == "mamba" else "use --no-peers"
        return f"--peer {peer} trains {trained} models; {preset_name} is a {kind} preset: {hint}"
    return library_problem(peer)


def library_problem(peer: str) -> str | None:
    """Why the libraries ``peer`` (or ``torchao``) trains with do not import here, else None."""
    modules, install = REQUIREMENTS[peer]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            flag = "--torchao" if peer == "torchao" else f"--peer {peer}"
            return f"{flag} needs {install}: importing {module} failed ({error})"
    return None


@dataclass
class TrainingLoop:
    """A peer ready to train: ``loss_of`` maps a micro-batch (``input_ids``, ``labels``) to its mean loss;
    ``restore`` undoes what building it changed outside the model."""

    parameters: list[torch.nn.Parameter]
    optimizer: Any  # step(), zero_grad(set_to_none=True)
    loss_of: Callable[[dict], torch.Tensor]
    clip: Callable[[list[torch.nn.Parameter]], Any] = field(
        default=lambda parameters: torch.nn.utils.clip_grad_norm_(parameters, 1.0))
    restore: Callable[[], None] = field(default=lambda: None)
    model: torch.nn.Module | None = None  # whose parameters ``scripts/benchmark_curve.py`` sets

    def step_function(self, micro_batches: list[dict], freed: dict, backward: BackwardStart) -> Callable[[int], None]:
        """One training step per call; the first records in ``freed["gradient_bytes"]`` the gradients' bytes, which
        the loop frees after every update (``zero_grad(set_to_none=True)``); ``backward`` watches every loss."""

        def step(i: int) -> None:
            backward.new_step()
            for micro_batch in micro_batches:
                loss = self.loss_of(micro_batch) / len(micro_batches)
                backward.watch(loss)
                loss.backward()
            if i == 0:
                freed["gradient_bytes"] = tensor_bytes(p.grad for p in self.parameters if p.grad is not None)
            self.clip(self.parameters)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        return step


def build_peer(peer: str, preset: dict, sequence_length: int, device: str, hf_experts: str = "grouped_mm",
               float8_recipe: str | None = None) -> TrainingLoop:
    if peer in ("hf", "hf-eager", "hf-amp"):
        return build_hf(preset, sequence_length, device, compiled=peer != "hf-eager", hf_experts=hf_experts,
                        float8_recipe=float8_recipe, autocast=peer == "hf-amp")
    if peer == "liger":
        return build_liger(preset, sequence_length, device, hf_experts)
    if peer == "torchtitan":
        return build_torchtitan(preset, sequence_length, device, compiled=True)
    if peer == "mamba-ssm":
        return build_mamba_ssm(preset, device)
    raise ValueError(f"unknown peer {peer!r}")


def hf_model(preset: dict, sequence_length: int, device: str, hf_experts: str,
             dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The ``transformers`` model of the preset, its weights in ``dtype``, SDPA attention, seeded."""
    import transformers

    kind = family(preset)
    experts = {"experts_implementation": hf_experts} if kind in ("mixtral", "qwen3_moe", "deepseek_v3") else {}
    config = getattr(transformers, f"{HF_CLASSES[kind]}Config")(**hf_fields(preset), attn_implementation="sdpa",
                                                              max_position_embeddings=sequence_length, dtype=dtype,
                                                              **experts)
    torch.manual_seed(0)
    return getattr(transformers, f"{HF_CLASSES[kind]}ForCausalLM")(config).to(device, dtype).train()


def hf_fields(preset: dict) -> dict:
    """The preset as ``transformers`` config fields: renamed keys, Qwen3-MoE's ``moe_config`` spread out."""
    fields = {HF_NAMES.get(key, key): value for key, value in preset.items() if key != "moe_config"}
    fields.pop(None, None)
    if "moe_config" in preset:
        moe = preset["moe_config"]
        fields |= {"num_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"],
                   "moe_intermediate_size": moe["moe_intermediate_size"], "norm_topk_prob": True}
    return fields


def fused_adamw(parameters: list[torch.nn.Parameter], device: str) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameters, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")


def build_hf(preset: dict, sequence_length: int, device: str, compiled: bool, hf_experts: str = "grouped_mm",
             float8_recipe: str | None = None, autocast: bool = False) -> TrainingLoop:
    """The plain ``transformers`` loop; compiled as nanotron's ``model.compile``: every decoder layer and the loss;
    with ``autocast``, fp32 weights under bf16 autocast."""
    model = hf_model(preset, sequence_length, device, hf_experts, torch.float32 if autocast else torch.bfloat16)
    precision = torch.autocast(device, dtype=torch.bfloat16, enabled=autocast)
    if float8_recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8_recipe),
                                   module_filter_fn=lambda module, name: name.startswith("model.layers."))

    def loss_of(logits, labels):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    if compiled:
        layers = model.model.layers
        # Each Hugging Face layer holds its own layer_idx, so each compiles once: allow one graph per layer, for
        # each of the loops a benchmark builds in its process (timed, then built again to be profiled).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(layers))
        for layer in layers:
            layer.compile()
        loss_of = torch.compile(loss_of)
    parameters = list(model.parameters())

    def forward_loss(micro_batch):
        with precision:
            return loss_of(model(input_ids=micro_batch["input_ids"]).logits, micro_batch["labels"])

    return TrainingLoop(parameters, fused_adamw(parameters, device), forward_loss, model=model)


def build_liger(preset: dict, sequence_length: int, device: str, hf_experts: str = "grouped_mm") -> TrainingLoop:
    """The ``transformers`` model patched by ``apply_liger_kernel_to_llama`` (or ``_mixtral``), eager. The loss comes
    from the model's forward (the fused linear cross-entropy), given the labels already shifted."""
    import liger_kernel.transformers as liger

    kind = family(preset)
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    saved = dict(vars(module))
    model = hf_model(preset, sequence_length, device, hf_experts)
    getattr(liger, f"apply_liger_kernel_to_{kind}")(model=model)

    def restore() -> None:
        """Liger also replaces the module's RoPE function and norm and MLP classes, for every model built later."""
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)

    parameters = list(model.parameters())
    return TrainingLoop(parameters, fused_adamw(parameters, device),
                        lambda micro_batch: model(input_ids=micro_batch["input_ids"],
                                                  shift_labels=micro_batch["labels"]).loss,
                        restore=restore, model=model)


def torchtitan_feed_forward(dim: int, intermediate_size: int) -> dict:
    """``TransformerModelArgs`` fields giving SwiGLU width ``intermediate_size``: torchtitan derives the width from
    ``dim`` (int(2 · 4 · dim / 3), times ``ffn_dim_multiplier``, rounded up to ``multiple_of``); rounding up to the
    width itself gives it exactly, from any start in (0, width]."""
    start = int(2 * 4 * dim / 3)
    return {"multiple_of": intermediate_size,
            "ffn_dim_multiplier": None if start <= intermediate_size else intermediate_size / start}


def torchtitan_job(sequence_length: int, compiled: bool):
    """torchtitan's job config for one device: per-block compile of the model and the loss, no activation
    checkpointing (its default is selective), fp32 parameters under bf16 autocast, its default fused AdamW."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.training.seq_len = sequence_length
    job.compile.enable = compiled
    job.activation_checkpoint.mode = "none"
    return job


def build_torchtitan(preset: dict, sequence_length: int, device: str, compiled: bool) -> TrainingLoop:
    """torchtitan's own model of the preset's family trained its way on one device, driven from here rather than from
    its CLI and TOML so that it reads the same batches. A tied preset shares the LM head's matrix with the embedding;
    the mixtures of experts balance with torchtitan's expert bias, updated by its optimizer hook, which reads its
    device mesh: a process group must exist (the benchmark's peers run in the world of one its nanotron run formed)."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers, build_optimizers_with_moe_load_balancing
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import clip_grad_norm_, maybe_enable_amp

    job = torchtitan_job(sequence_length, compiled)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model_class, args, parallelize = TORCHTITAN_MODELS[family(preset)](preset)
    args.update_from_config(job)
    with torch.device("meta"):
        model = model_class(args)
    model = parallelize(model, dims, job)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    if preset.get("tie_word_embeddings") and family(preset) in ("llama", "mixtral"):
        model.tok_embeddings.weight = model.output.weight
    model.train()
    loss_sum = build_cross_entropy_loss(job)
    autocast = maybe_enable_amp(dims, job.training.mixed_precision_param, device)

    def loss_of(micro_batch):
        with autocast:
            return loss_sum(model(micro_batch["input_ids"]), micro_batch["labels"]) / micro_batch["labels"].numel()

    optimizers = build_optimizers if family(preset) in ("llama", "qwen3") else build_optimizers_with_moe_load_balancing
    parameters = list(model.parameters())
    return TrainingLoop(parameters, optimizers([model], job.optimizer, dims), loss_of,
                        clip=lambda parameters: clip_grad_norm_(parameters, 1.0, foreach=True), model=model)


def torchtitan_llama_shape(preset: dict) -> dict:
    """The ``TransformerModelArgs`` fields of torchtitan's Llama 3 and Llama 4 at the preset's shape."""
    return {"dim": preset["hidden_size"], "n_layers": preset["num_hidden_layers"],
            "n_heads": preset["num_attention_heads"], "n_kv_heads": preset["num_key_value_heads"],
            "vocab_size": preset["vocab_size"], "rope_theta": preset.get("rope_theta", 10000.0),
            "norm_eps": preset.get("rms_norm_eps", 1e-6),
            **torchtitan_feed_forward(preset["hidden_size"], preset["intermediate_size"])}


def torchtitan_llama3(preset: dict):
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    args = TransformerModelArgs(
        **torchtitan_llama_shape(preset),
        rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0))  # its default stretches RoPE as Llama 3.1: off
    return Transformer, args, parallelize_llama


def torchtitan_llama4(preset: dict):
    """torchtitan's Llama 4 as Mixtral: grouped-query attention with RoPE in every layer (no NoPE layers, hence none
    of its fixed attention blocks) and unscaled; experts in every layer, none shared, each as wide as
    ``intermediate_size`` (not divided by the top-k); softmax routing with the top-k renormalised, the expert outputs
    weighed by their scores. Mixtral balances the experts with an auxiliary loss; torchtitan with its expert bias
    (``load_balance_coeff``), updated by its optimizer hook: this peer keeps torchtitan's way."""
    from torchtitan.models.llama4 import Transformer, TransformerModelArgs, parallelize_llama
    from torchtitan.models.moe import MoEArgs

    args = TransformerModelArgs(
        **torchtitan_llama_shape(preset), rope_scaling_args=None, every_n_layers_nope=None,
        interleave_moe_layer_step=1, auto_scale_hidden_dim=False,
        moe_args=MoEArgs(num_experts=preset["moe_num_experts"], num_shared_experts=0,
                         top_k=preset["num_experts_per_tok"], score_func="softmax", route_norm=True,
                         score_before_experts=False))
    return Transformer, args, parallelize_llama


def torchtitan_qwen3(preset: dict):
    """torchtitan's Qwen3, dense or (with ``moe_config``) with experts in every layer, routed as Qwen3-MoE's
    (softmax, the top-k renormalised)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs, parallelize_qwen3

    moe = preset.get("moe_config")
    experts = {} if moe is None else {
        "moe_enabled": True, "moe_inter_dim": moe["moe_intermediate_size"],
        "moe_args": MoEArgs(num_experts=moe["num_experts"], num_shared_experts=0, top_k=moe["top_k"],
                            score_func="softmax", route_norm=True, score_before_experts=False)}
    args = Qwen3ModelArgs(
        dim=preset["hidden_size"], n_layers=preset["num_hidden_layers"], n_heads=preset["num_attention_heads"],
        n_kv_heads=preset["num_key_value_heads"], head_dim=preset["head_dim"], vocab_size=preset["vocab_size"],
        hidden_dim=preset["intermediate_size"], rope_theta=preset["rope_theta"], qk_norm=True,
        enable_weight_tying=preset["tie_word_embeddings"], **experts)
    return Qwen3Model, args, parallelize_qwen3


def torchtitan_deepseek_v3(preset: dict):
    """torchtitan's DeepSeek-V3: MLA, sigmoid routing with the expert bias, shared experts, the first layers dense;
    plain RoPE (its YaRN stretch starts past ``original_seq_len``, set to the sequence length)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, parallelize_deepseekv3
    from torchtitan.models.moe import MoEArgs

    groups = preset.get("n_group", 1)
    args = DeepSeekV3ModelArgs(
        vocab_size=preset["vocab_size"], dim=preset["hidden_size"], inter_dim=preset["intermediate_size"],
        moe_inter_dim=preset["moe_intermediate_size"], n_layers=preset["num_hidden_layers"],
        n_dense_layers=preset["first_k_dense_replace"], n_heads=preset["num_attention_heads"],
        moe_args=MoEArgs(num_experts=preset["n_routed_experts"], num_shared_experts=preset["n_shared_experts"],
                         top_k=preset["num_experts_per_tok"], score_func="sigmoid", route_norm=True,
                         route_scale=preset["routed_scaling_factor"], score_before_experts=False,
                         num_expert_groups=groups if groups > 1 else None,
                         num_limited_groups=preset.get("topk_group") if groups > 1 else None),
        q_lora_rank=preset["q_lora_rank"] or 0, kv_lora_rank=preset["kv_lora_rank"],
        qk_nope_head_dim=preset["qk_nope_head_dim"], qk_rope_head_dim=preset["qk_rope_head_dim"],
        v_head_dim=preset["v_head_dim"], rope_theta=preset["rope_theta"], original_seq_len=1 << 30,
        attn_type="sdpa", attn_mask_type="causal")
    return DeepSeekV3Model, args, parallelize_deepseekv3


# Each family's torchtitan model: its class, its arguments at the preset's shape and its parallelize function.
TORCHTITAN_MODELS = {"llama": torchtitan_llama3, "mixtral": torchtitan_llama4, "qwen3": torchtitan_qwen3,
                     "qwen3_moe": torchtitan_qwen3, "deepseek_v3": torchtitan_deepseek_v3}


def build_mamba_ssm(preset: dict, device: str) -> TrainingLoop:
    """The authors' ``mamba_ssm`` model (its CUDA selective scan, causal-conv1d and fused add-norm kernels)."""
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    config = MambaConfig(d_model=preset["d_model"], n_layer=preset["num_hidden_layers"],
                         vocab_size=preset["vocab_size"], ssm_cfg={"layer": "Mamba1", **preset["ssm_cfg"]},
                         rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8,
                         tie_embeddings=preset["tie_word_embeddings"])
    torch.manual_seed(0)
    model = MambaLMHeadModel(config, device=device, dtype=torch.bfloat16).train()

    def loss_of(micro_batch):
        logits = model(micro_batch["input_ids"]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), micro_batch["labels"].flatten())

    parameters = list(model.parameters())
    return TrainingLoop(parameters, fused_adamw(parameters, device), loss_of, model=model)
