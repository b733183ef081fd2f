"""AdamW on fp32 master weights, with optional fp32 gradient accumulation.

When the model runs in bf16/fp16, the optimizer keeps an fp32 copy of every parameter ("master weights") and
updates that copy: small updates that would vanish when added to a bf16 weight are kept. After each step the
masters are copied back into the model. With ``accumulate_grad_in_fp32`` each micro-batch's low-precision gradient
is added into an fp32 buffer as soon as it is produced (a post-accumulate-grad hook), so the sum over micro-batches
is not rounded to bf16 at every addition.

State is keyed by logical parameter names, never by position, so checkpoints load into any layout.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from nanotron.config import OptimizerArgs


def no_weight_decay(name: str, param: torch.Tensor, exclude_patterns: list[str] | None) -> bool:
    """Built-in rule: norms and biases (1-D tensors) and embeddings are not decayed; patterns replace the rule."""
    if exclude_patterns is not None:
        return any(re.search(pattern, name) for pattern in exclude_patterns)
    return param.dim() < 2 or "embed" in name


class MixedPrecisionAdamW:
    def __init__(self, params: dict[str, nn.Parameter], args: OptimizerArgs):
        self.params = params
        self.args = args
        self.separate_masters = any(p.dtype != torch.float32 for p in params.values())
        self.accumulate_in_fp32 = self.separate_masters and args.accumulate_grad_in_fp32
        self.masters: dict[str, torch.Tensor] = {
            name: (p.detach().float().clone().requires_grad_(True) if self.separate_masters else p)
            for name, p in params.items()
        }
        if self.accumulate_in_fp32:
            for name, p in params.items():
                p.register_post_accumulate_grad_hook(self._accumulate_hook(self.masters[name]))

        decay, no_decay = [], []
        for name, p in params.items():
            (no_decay if no_weight_decay(name, p, args.weight_decay_exclude_named_params) else decay).append(name)
        self.no_decay_names = set(no_decay)
        groups = [
            {"params": [self.masters[n] for n in decay], "weight_decay": args.weight_decay},
            {"params": [self.masters[n] for n in no_decay], "weight_decay": 0.0},
        ]
        on_cuda = any(p.is_cuda for p in params.values())
        self.inner = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=args.learning_rate_scheduler.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            fused=bool(args.torch_adam_is_fused and on_cuda) or None,
        )

    @staticmethod
    def _accumulate_hook(master: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

        return hook

    def gradients_to_reduce(self) -> list[torch.Tensor]:
        """The tensors holding this step's gradients, for data-parallel reduction."""
        if self.accumulate_in_fp32:
            return [m.grad for m in self.masters.values() if m.grad is not None]
        return [p.grad for p in self.params.values() if p.grad is not None]

    def main_gradients(self) -> dict[str, torch.Tensor]:
        """fp32 gradients of the master weights (created as zeros for parameters that got none)."""
        for name, master in self.masters.items():
            param = self.params[name]
            if self.separate_masters and not self.accumulate_in_fp32 and param.grad is not None:
                master.grad = param.grad.float()
                param.grad = None
            if master.grad is None:
                master.grad = torch.zeros_like(master)
        return {name: m.grad for name, m in self.masters.items()}

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        if self.separate_masters:
            for name, master in self.masters.items():
                self.params[name].copy_(master)

    def zero_grad(self) -> None:
        for name, master in self.masters.items():
            master.grad = None
            self.params[name].grad = None

    # --- checkpointing -------------------------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        states = [self.inner.state[m] for m in self.masters.values() if m in self.inner.state]
        return int(states[0]["step"]) if states else 0

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per logical parameter: Adam moments and (when separate) the fp32 master weight."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, master in self.masters.items():
            state = self.inner.state.get(master, {})
            tensors = {key: state[key] for key in ("exp_avg", "exp_avg_sq") if key in state}
            if self.separate_masters:
                tensors["master"] = master.detach()
            out[name] = tensors
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Restore moments and masters in fp32 (never through the model dtype), then resync the model weights."""
        for name, master in self.masters.items():
            saved = tensors[name]
            if self.separate_masters:
                master.copy_(saved["master"])
                self.params[name].copy_(master)
            if "exp_avg" in saved:
                step_device = master.device if self.inner.defaults.get("fused") else torch.device("cpu")
                self.inner.state[master] = {
                    "step": torch.tensor(float(step), dtype=torch.float32, device=step_device),
                    "exp_avg": saved["exp_avg"].to(master.device, torch.float32).clone(),
                    "exp_avg_sq": saved["exp_avg_sq"].to(master.device, torch.float32).clone(),
                }
