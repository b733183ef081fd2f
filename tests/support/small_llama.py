"""A small Llama built in this process, its loss and gradients on a fixed batch, with its layers recomputed or
compiled, and the attention kernels it runs."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanotron.config import LlamaConfig
from nanotron.models.llama.model import LlamaForCausalLM
from nanotron.nn.recompute import ATTENTION_OPS, compile_layer, recompute_in_backward

SMALL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
BATCH, SEQ = 2, 16


class AttentionCalls(TorchDispatchMode):
    """Counts the attention kernels' forward ops that run (an op selective recomputation hands back from its cache
    in the backward never reaches this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def small_llama(config: LlamaConfig = SMALL, device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, config.vocab_size).to(device)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    return model


def recomputed(model: LlamaForCausalLM, recompute: str | None, compiled: bool = False) -> LlamaForCausalLM:
    model = copy.deepcopy(model)
    for layer in model.layers.values():
        if recompute is not None:
            recompute_in_backward(layer, recompute)
        if compiled:
            compile_layer(layer)
    return model


def loss_and_gradients(model, ids: torch.Tensor, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, **inputs).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def ids_for(config: LlamaConfig, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)


def assert_same_gradients(got: dict, expected: dict, atol: float, rtol: float = 0.0) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=rtol, atol=atol, msg=name)
