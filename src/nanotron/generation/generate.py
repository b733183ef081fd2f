"""Autoregressive generation from a checkpoint, at any tensor- and pipeline-parallel layout.

Prompts of different lengths are left-padded; a boolean mask keeps padding out of attention and positions count
only real tokens. With the family's inference cache (Llama: keys and values; DeepSeek-V3: the kv latents) each new
token costs one forward of length 1; without it the whole sequence is recomputed (kept to check the cache). Tensor
parallelism runs in ALL_REDUCE mode (a single new token cannot be split along the sequence); logits are gathered
over TP ranks to sample. With pipeline parallelism, hidden states go from stage to stage and the last stage
broadcasts each sampled token to every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nanotron.checkpoint.integrity import read_metadata
from nanotron.checkpoint.manager import checkpoint_model, load_weights, verify_on_all_ranks
from nanotron.checkpoint.run_folder import resolve_checkpoint
from nanotron.config import ConfigError
from nanotron.errors import CheckpointError
from nanotron.layout import Axis, Group
from nanotron.models.build import BuildOptions, build_model, stage_chunks
from nanotron.models.registry import check_model_config, spec_for_config
from nanotron.models.spec import CausalLM
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.pipeline_parallel import P2P

SAMPLERS = ("greedy", "top-k", "top-p")


@dataclass
class SamplingArgs:
    sampler: str = "greedy"
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9
    seed: int = 0


def sample(logits: torch.Tensor, args: SamplingArgs, generator: torch.Generator) -> torch.Tensor:
    """Next token per row of ``logits`` [batch, vocab] (fp32)."""
    if args.sampler == "greedy":
        return logits.argmax(dim=-1)
    logits = logits / max(args.temperature, 1e-5)
    if args.sampler == "top-k":
        values, indices = logits.topk(min(args.top_k, logits.shape[-1]), dim=-1)
        choice = torch.multinomial(values.softmax(-1), 1, generator=generator)
        return indices.gather(-1, choice).squeeze(-1)
    if args.sampler == "top-p":
        probs, indices = logits.softmax(-1).sort(dim=-1, descending=True)
        keep = probs.cumsum(-1) - probs < args.top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.where(keep, probs, 0.0)
        choice = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)
        return indices.gather(-1, choice).squeeze(-1)
    raise ValueError(f"unknown sampler {args.sampler!r}; choose one of {', '.join(SAMPLERS)}")


def load_model(ckpt_path: Path, parallel_context: ParallelContext) -> tuple[CausalLM, Path]:
    """The checkpoint's model for this rank at the context's tp/pp (ALL_REDUCE mode), in eval mode."""
    checkpoint = resolve_checkpoint(Path(ckpt_path))
    metadata = read_metadata(checkpoint)
    verify_on_all_ranks(checkpoint, metadata, parallel_context)
    model_config = checked_model_config(checkpoint, metadata, parallel_context.size(Axis.TP))
    # The sequence length only weighs attention in the pipeline split; a family without a context limit keeps the
    # default.
    options = BuildOptions(dtype=getattr(torch, metadata["model"]["dtype"]),
                           sequence_length=model_config.context_length
                           or BuildOptions.sequence_length)
    model = build_model(model_config, parallel_context, options)
    load_weights(checkpoint, model, parallel_context, metadata)
    return model.eval(), checkpoint


def checked_model_config(checkpoint: Path, metadata: dict, tp: int, **keys):
    """The checkpoint's model config, refused with one line per problem if its model cannot run at ``tp`` ranks
    (``keys``: a sequence length to check too, see ``model_config_problems``)."""
    _, model_config = checkpoint_model(checkpoint, metadata)
    check_model_config(model_config, tp, checkpoint / "checkpoint.json", key="model.config", tp_key="--tp", **keys)
    return model_config


def check_checkpoint_layout(ckpt_path: Path, tp: int, **keys) -> None:
    """``checked_model_config`` before any process group exists: a launch at a tp the model cannot be split over
    (heads, kv heads) stops with that one line, not with a world-size error or a shape error inside a layer."""
    checkpoint = resolve_checkpoint(Path(ckpt_path))
    checked_model_config(checkpoint, read_metadata(checkpoint), tp, **keys)


def check_within_context(model_config, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse to generate past the positions the model was trained for (``max_position_embeddings``, where the
    family has one): beyond them it runs silently on positions it never saw."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    limit = model_config.context_length
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        fix = (f"pass --max-new-tokens {limit - prompt_tokens} or less" if prompt_tokens < limit
               else "shorten the prompt")
        raise ConfigError(f"the longest prompt ({prompt_tokens} tokens) plus --max-new-tokens ({max_new_tokens}) is "
                          f"{prompt_tokens + max_new_tokens} positions, more than the {limit} the model was trained "
                          f"for (max_position_embeddings); {fix}")


def _attention_mask(valid: torch.Tensor, queries: int) -> torch.Tensor:
    """[batch, 1, queries, keys]: causal over the last ``queries`` positions, padding keys hidden.

    A padding query may see itself, so that no row is fully masked (which would produce NaNs).
    """
    keys = valid.shape[1]
    query_index = torch.arange(keys - queries, keys, device=valid.device)[:, None]
    key_index = torch.arange(keys, device=valid.device)[None, :]
    causal = key_index <= query_index
    return (causal & (valid[:, None, :] | (key_index == query_index)))[:, None]


@torch.no_grad()
def generate(model: CausalLM, parallel_context: ParallelContext, prompts: list[list[int]], max_new_tokens: int,
             sampling: SamplingArgs, eos_token_id: int | None, vocab_size: int, use_cache: bool = True,
             pad_token_id: int = 0) -> list[list[int]]:
    """New tokens for every prompt (stopping at EOS, which is kept, or after ``max_new_tokens``)."""
    pc, device = parallel_context, parallel_context.device
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    check_within_context(model.config, longest, max_new_tokens)
    tokens = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long, device=device)
    valid = torch.zeros_like(tokens, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt):] = torch.tensor(prompt, device=device)
        valid[row, longest - len(prompt):] = True

    new_cache = spec_for_config(model.config).inference_cache
    caches = {index: new_cache() for index in model.layers} if use_cache else None
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    new_tokens: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        fed = 1 if use_cache and step > 0 else tokens.shape[1]
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, -fed:]
        logits = forward_logits(model, pc, tokens[:, -fed:], positions, _attention_mask(valid, fed), caches)
        if pc.is_last_stage:
            next_token = sample(logits[:, :vocab_size].float(), sampling, generator)
        else:
            next_token = torch.empty(len(prompts), dtype=torch.long, device=device)
        if pc.size(Axis.PP) > 1:
            dist.broadcast(next_token, src=pc.members(Group.PP)[-1], group=pc.group(Group.PP))
        next_token = torch.where(done, pad_token_id, next_token)
        new_tokens.append(next_token)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        valid = torch.cat([valid, ~done[:, None]], dim=1)
        if eos_token_id is not None:
            done |= next_token == eos_token_id
        if bool(done.all()):
            break
    stacked = torch.stack(new_tokens, dim=1).tolist()
    return [_until_eos(row, eos_token_id) for row in stacked]


def _until_eos(row: list[int], eos_token_id: int | None) -> list[int]:
    return row[: row.index(eos_token_id) + 1] if eos_token_id is not None and eos_token_id in row else row


def forward_logits(model: CausalLM, pc: ParallelContext, ids: torch.Tensor, positions: torch.Tensor | None,
                   mask: torch.Tensor | None, caches: dict[str, object] | None, last_only: bool = True,
                   gather: bool = True, document_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Logits over the padded vocabulary on the stage of the LM head (None elsewhere), gathered over TP unless
    ``gather`` is False (then each TP rank keeps its vocabulary shard). Through the pipeline one model chunk after the
    other (a stage may hold several, ``stage_chunks``: a DoReMi reference at the run's layout).

    Only the last position's ([batch, vocab]) unless ``last_only`` is False ([batch, seq, vocab]). ``document_ids``
    (with ``positions`` restarting in each document, as a micro-batch under document masking holds them) keep
    attention inside each document packed in ``ids``.
    """
    hidden_size = model.config.hidden_size
    dtype = model.config.activation_dtype(next(model.parameters()).dtype)
    p2p = P2P(pc, (ids.shape[0], ids.shape[1], hidden_size), dtype, timeout_s=600.0)
    layout, stage = pc.layout, pc.coord(Axis.PP)
    documents = {} if document_ids is None else {"document_ids": document_ids}  # only families with attention take it
    out = None
    for chunk, view in zip(layout.chunks_of(stage), stage_chunks(model), strict=True):
        if chunk > 0 and layout.stage_of(chunk - 1) != stage:
            out = p2p.recv_from(layout.stage_of(chunk - 1))
        out = view(input_ids=ids, hidden_states=out, position_ids=positions, attention_mask=mask, caches=caches,
                   **documents)
        if chunk < layout.chunks - 1 and layout.stage_of(chunk + 1) != stage:
            p2p.send_to(out, layout.stage_of(chunk + 1))
    if model.lm_head is None:
        return None
    logits = out[:, -1].contiguous() if last_only else out.contiguous()
    if gather and pc.size(Axis.TP) > 1:
        shards = [torch.empty_like(logits) for _ in range(pc.size(Axis.TP))]
        dist.all_gather(shards, logits, group=pc.group(Group.TP))
        logits = torch.cat(shards, dim=-1)
    return logits


def checkpoint_tokenizer(checkpoint: Path) -> str | Path:
    """The tokenizer stored in the checkpoint, else the one its training config names (a path or a Hub name)."""
    from nanotron.config import load_config

    if (checkpoint / "tokenizer" / "tokenizer.json").exists():
        return checkpoint / "tokenizer" / "tokenizer.json"
    if (checkpoint / "config.yaml").exists():
        name = load_config(checkpoint / "config.yaml").tokenizer.tokenizer_name_or_path
        if name:
            return name
    raise CheckpointError(f"{checkpoint} has no tokenizer (tokenizer/tokenizer.json) and its config names none")


def load_checkpoint_tokenizer(checkpoint: Path):
    """The checkpoint's tokenizer (``checkpoint_tokenizer``), loaded."""
    from nanotron.data.tokenizer import load_tokenizer

    return load_tokenizer(checkpoint_tokenizer(checkpoint))
