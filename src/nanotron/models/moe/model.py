"""Mixture of experts: Llama whose feed-forward blocks send each token to ``k`` of ``E`` gated MLP experts (Mixtral,
nanotron's LlaMoE). Pure like every model here: expert parallelism and tensor parallelism change the block from
outside (``parallel/expert_parallel.py``, ``parallel/tensor_parallel.py``).

A block's forward:

1. **route**: the router's fp32 logits give each token's top-k experts and combine weights (the top-k softmax
   probabilities, renormalised to sum to one unless ``moe_normalize_topk`` is off). With a capacity factor, an
   expert takes at most ``ceil(factor * tokens * k / E)`` assignments of the micro-batch; first choices go before
   second choices and earlier tokens before later ones, so the same batch always drops the same assignments.
   Without one (the default) no token is dropped. DeepSeek-V3's routing (``scoring: sigmoid`` in the settings)
   chooses by sigmoid scores plus the block's ``expert_bias`` within the best expert groups instead, and weighs by
   the chosen scores (``Selection``, ``choose_experts``).
2. **permute**: assignments are sorted by expert (a stable sort on the device: no host sync), so each expert's
   tokens are one contiguous block and the experts run as grouped GEMMs (``GroupedExperts``).
3. **combine**: the outputs go back to assignment order and each token sums its rows, times their weights;
4. **shared expert** (Qwen2's, when the settings have one): every token also goes through one more expert,
   scaled by ``sigmoid(shared_expert_gate(x))``, added to the routed sum.

The block reads its sizes from the config's ``moe`` (``MoESettings``), so any family's config can carry experts.

The auxiliary losses are sums over sequences, so that dividing by the step's number of sequences (the step
term is given it) gives the same value and gradients for any split of the global batch over ranks and micro-batches
(with ``balance_scope: global_batch`` the balance loss's shares are the global batch's instead:
``global_balance.py``):

- load balancing (Switch Transformer, per sequence as in DeepSeek-V3): ``E * sum_e f_e * P_e`` with ``f_e`` the
  share of the sequence's assignments that chose expert ``e`` and ``P_e`` its mean router probability; 1 when
  routing is uniform;
- z-loss (ST-MoE): the mean over the sequence's tokens of ``logsumexp(logits)^2``, which keeps logits small.

Both are averaged over the MoE layers and computed in fp32. Given the whole sequence's selection counts (``f_e``
and the sequence's length), both are sums of per-token terms: a rank that holds part of each sequence (context
parallelism) records its own tokens' part, and the parts add up over those ranks. The counts are completed by the
block's ``sequence_sum`` (``nn/sequence_sum.py``: nothing to do on one rank, a sum over the ranks under context
parallelism). Every forward leaves its ``RouterRecord`` on the block; ``router_losses`` collects them after each
micro-batch of a pipeline stage, for the family's step term ``RouterLosses`` (``router_terms``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanotron.config import Config, LlamaConfig, LlaMoEConfig
from nanotron.config.llama import HiddenAct
from nanotron.models.init import normal
from nanotron.models.llama.model import LlamaForCausalLM, LlamaMLP, llama_init_rule
from nanotron.models.moe.global_balance import GlobalBalance, balance_from_sums
from nanotron.models.spec import Initializer
from nanotron.nn.glu import glu
from nanotron.nn.linear import Linear
from nanotron.nn.sequence_sum import SequenceSum
from nanotron.parallel.statistics import Statistics


@dataclass
class Routing:
    """The kept (token, expert) assignments of a batch of tokens, flat, in token order."""

    token_index: torch.Tensor | None  # [assignments] row of each token; None: dropless, token t owns rows t*k..t*k+k-1
    expert_index: torch.Tensor  # [assignments]
    weight: torch.Tensor  # [assignments] fp32 combine weight


@dataclass
class RouterRecord:
    """What one forward of a block reports: auxiliary loss sums over its sequences (differentiable; this rank's
    tokens' part where the sequences are split over ranks) and counts."""

    balance: torch.Tensor  # sum over sequences of E * sum_e f_e * P_e
    z: torch.Tensor  # sum over sequences of mean_t logsumexp(logits_t)^2
    tokens_per_expert: torch.Tensor  # [E] assignments each expert was chosen for (before capacity dropping)
    dropped: torch.Tensor  # assignments dropped by the capacity limit
    probabilities: torch.Tensor  # [E] each expert's router probability summed over the tokens (the global balance's)


@dataclass(frozen=True)
class Selection:
    """DeepSeek-V3's choice of experts: sigmoid scores plus ``bias`` [E] (for the choice only), within the
    ``topk_group`` groups (of ``n_group`` consecutive experts) whose two best biased scores sum highest; the chosen
    experts weigh by their scores times ``scale``."""

    bias: torch.Tensor
    n_group: int
    topk_group: int
    scale: float


def choose_experts(logits: torch.Tensor, top_k: int, normalize: bool, selection: Selection | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's router probabilities (what the balance loss averages: the softmax, or the sigmoid scores
    normalised to sum to one), its ``top_k`` experts and their combine weights (renormalised with ``normalize``)."""
    if selection is None:
        probs = logits.softmax(-1)
        top_probs, top_experts = probs.topk(top_k, dim=-1)
    else:
        scores = logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
        # The choice is indices only: made on detached scores, it leaves no autograd nodes behind.
        biased = scores.detach() + selection.bias
        grouped = biased.unflatten(-1, (selection.n_group, -1))
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(selection.topk_group, dim=-1).indices
        allowed = torch.zeros_like(grouped[..., 0]).scatter_(-1, best_groups, 1.0).bool()
        biased = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).flatten(-2)
        top_experts = biased.topk(top_k, dim=-1).indices
        top_probs = scores.gather(-1, top_experts)
    weights = top_probs / top_probs.sum(-1, keepdim=True) if normalize else top_probs
    return probs, top_experts, weights if selection is None else weights * selection.scale


def route(logits: torch.Tensor, top_k: int, normalize: bool, capacity_factor: float | None,
          sequence_sum: Callable[[torch.Tensor], torch.Tensor] = lambda sums: sums,
          selection: Selection | None = None) -> tuple[Routing, RouterRecord]:
    """Top-k routing of ``logits`` [sequences, positions, E] (fp32), and the record of its auxiliary terms.

    ``sequence_sum`` turns per-sequence sums over these positions into the whole sequences' (the default: these
    positions are the whole sequences); ``selection``: DeepSeek-V3's sigmoid routing (None: softmax)."""
    sequences, positions, experts = logits.shape
    probs, top_experts, weights = choose_experts(logits, top_k, normalize, selection)

    chosen = torch.zeros_like(probs).scatter_add_(-1, top_experts, torch.ones_like(weights))  # [S, P, E] 0/1
    selections = sequence_sum(chosen.sum(1))  # [S, E] of the whole sequences; counts, no gradient
    length = selections.sum(-1, keepdim=True) / top_k  # [S, 1] tokens of each whole sequence
    share = selections / (length * top_k)  # f_e per sequence
    balance = experts * (share * probs.sum(1) / length).sum()
    z = (logits.logsumexp(-1).pow(2).sum(-1, keepdim=True) / length).sum()
    tokens_per_expert = chosen.sum((0, 1))
    probabilities = probs.sum((0, 1))

    tokens = sequences * positions
    token_index, expert_index, weight = None, top_experts.reshape(-1), weights.reshape(-1)
    dropped = torch.zeros((), device=logits.device)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * tokens * top_k / experts)
        # Priority order: every token's first choice, then every second choice, ... (token order within each).
        by_choice = expert_index.view(tokens, top_k).t().reshape(-1)
        position = (F.one_hot(by_choice, experts).cumsum(0) * F.one_hot(by_choice, experts)).sum(-1) - 1
        keep = (position < capacity).view(top_k, tokens).t().reshape(-1)
        dropped = (~keep).sum().float()
        token_index = torch.arange(tokens, device=logits.device).repeat_interleave(top_k)[keep]
        expert_index, weight = expert_index[keep], weight[keep]
    record = RouterRecord(balance, z, tokens_per_expert, dropped, probabilities)
    return Routing(token_index, expert_index, weight), record


class _Permute(torch.autograd.Function):
    """``x[order]`` for a permutation ``order`` of the rows; the backward gathers by the inverse permutation, where
    autograd's indexing backward would sort the indices to accumulate (measured: 11.6 of a 168 ms MoE step on an
    H200)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x[order]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def run_experts(experts: GroupedExperts, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The experts of this process on tokens already grouped by expert (no parallelism: every expert is here)."""
    return experts(tokens, tokens_per_expert)


class GroupedExperts(nn.Module):
    """``num_experts`` gated MLPs (``nn/glu.py`` with ``activation``; silu: SwiGLU) stored as [experts, ...] tensors,
    laid out like Hugging Face's Mixtral: ``gate_up_proj`` [E, 2 * ffn, hidden] (gate rows, then up rows) and
    ``down_proj`` [E, hidden, ffn].

    On CUDA in bf16 the experts run as two grouped GEMMs (``torch._grouped_mm``, where the torch build has it) over
    the expert offsets, with no host sync; elsewhere a loop over experts is the reference. ``grouped_mm`` forces
    one or the other (tests compare them). ``expert_matmul``, set per instance by a module converter (FP8), is a
    ``F.linear``-like product that the loop then uses for each expert's two matmuls; if it has a ``token_alignment``,
    each expert's tokens are padded with zero rows to a multiple of it. If it also has grouped products
    (``grouped(x, weight, offsets)``, where its ``groups(x, *weights)`` says they run: FP8's
    ``torch._scaled_grouped_mm``), the experts run as two of them over aligned groups, with no loop and no host
    sync (``_grouped_layout``); ``grouped_mm = False`` forces the loop there too.
    """

    grouped_mm: bool | None = None  # None: grouped GEMMs where they are supported
    matrix_parameters = ("gate_up_proj", "down_proj")  # stacks of matrices, one per expert (Muon: each on its own)
    expert_matmul = None  # (input, weight) -> output for one expert; None: F.linear, or the grouped GEMMs

    def __init__(self, num_experts: int, hidden_size: int, ffn: int, activation: HiddenAct = "silu"):
        super().__init__()
        self.num_experts, self.hidden_size, self.ffn, self.activation = num_experts, hidden_size, ffn, activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn))

    def _use_grouped_mm(self, x: torch.Tensor) -> bool:
        if self.grouped_mm is not None:
            return self.grouped_mm
        return hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x`` [tokens, hidden] holds expert 0's tokens, then expert 1's, ... (``tokens_per_expert`` of each)."""
        if self.expert_matmul is None and self._use_grouped_mm(x):
            offsets = tokens_per_expert.cumsum(0).to(torch.int32)
            hidden = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(glu(hidden, self.activation), self.down_proj.transpose(-2, -1), offs=offsets)
        matmul = self.expert_matmul or F.linear
        if (self.grouped_mm is not False and hasattr(matmul, "grouped")
                and matmul.groups(x, self.gate_up_proj, self.down_proj)):
            x, rows, offsets = _grouped_layout(x, tokens_per_expert, matmul.token_alignment)
            hidden = glu(matmul.grouped(x, self.gate_up_proj, offsets), self.activation)
            return matmul.grouped(hidden, self.down_proj, offsets).index_select(0, rows)
        alignment = getattr(matmul, "token_alignment", 1)
        if alignment > 1:
            x, rows, counts = _aligned_groups(x, tokens_per_expert, alignment)
        else:
            counts = tokens_per_expert.tolist()
        outputs = []
        for expert, chunk in enumerate(x.split(counts)):
            hidden = glu(matmul(chunk, self.gate_up_proj[expert]), self.activation)
            outputs.append(matmul(hidden, self.down_proj[expert]))
        out = torch.cat(outputs)
        return out if alignment == 1 else out.index_select(0, rows)


def _aligned_groups(x: torch.Tensor, tokens_per_expert: torch.Tensor, alignment: int
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``x``'s expert groups each padded with zero rows to a multiple of ``alignment`` (at least one: an expert
    without tokens gets ``alignment`` zero rows): the padded tokens, the row of every token among them, and the
    padded counts.

    A matmul that needs aligned token counts (FP8's ``torch._scaled_mm``) could pad each product itself, but under
    torch.compile the counts are symbolic, and testing their alignment guards the graph on it: one graph per pattern
    of aligned and unaligned experts, past the recompile limit. Counts that are multiples by construction pass
    that test every time. The compiler also specialises a count of zero (and the product tests for an empty
    input), so no count is zero either."""
    rows, padded = _aligned_rows(tokens_per_expert, alignment, x.shape[0])
    counts = padded.tolist()
    return x.new_zeros(sum(counts), x.shape[1]).index_copy(0, rows, x), rows, counts


def _grouped_layout(x: torch.Tensor, tokens_per_expert: torch.Tensor, alignment: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_aligned_groups`` for grouped products, without a host sync: the padded tokens, the row of every token among
    them, and the groups' int32 cumulative ends. The padded total depends on the counts, so the tensor takes the
    most it can need, ``x``'s rows rounded up plus ``alignment`` per expert (a shape known from ``x``'s alone), and
    the last expert's group runs to its end: every row belongs to a group and the rows past the tokens are zeros,
    which add nothing to the products, the amaxes or the gradients."""
    rows, padded = _aligned_rows(tokens_per_expert, alignment, x.shape[0])
    capacity = -(-x.shape[0] // alignment) * alignment + alignment * tokens_per_expert.shape[0]
    ends = torch.cat([padded.cumsum(0)[:-1], padded.new_full((1,), capacity)]).to(torch.int32)
    return x.new_zeros(capacity, x.shape[1]).index_copy(0, rows, x), rows, ends


def _aligned_rows(tokens_per_expert: torch.Tensor, alignment: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row of each of the ``tokens`` tokens once every expert's group is padded to a multiple of ``alignment``
    (at least one), and the padded counts."""
    padded = ((tokens_per_expert + alignment - 1) // alignment * alignment).clamp(min=alignment)
    ends = tokens_per_expert.cumsum(0)
    shift = (padded.cumsum(0) - padded) - (ends - tokens_per_expert)  # each group's start, padded minus unpadded
    token = torch.arange(tokens, device=tokens_per_expert.device)
    return token + shift[torch.searchsorted(ends, token, right=True)], padded


class MoEFeedForward(nn.Module):
    """Router plus experts (plus the shared expert and its gate, where the settings have one) in place of a dense MLP.

    ``exchange(experts, tokens, tokens_per_expert)`` runs the experts on tokens grouped by expert: here directly;
    expert parallelism replaces it with an all-to-all to the ranks that hold them. The shared expert is a
    one-expert ``GroupedExperts`` that every token visits, so that tensor parallelism and FP8 treat it as they treat
    the routed experts; it stays whole on every expert-parallel rank. ``sequence_sum`` completes the router's
    per-sequence counts where a rank holds parts of sequences (context parallelism swaps it). ``auxiliary_share`` is
    the part of the auxiliary losses this copy of the block backpropagates (tensor parallelism computes the router on
    every rank and sums its gradients, so each rank takes 1/tp). The router and the shared expert's gate stay in the
    model dtype when the decoder's linears take low-precision products (``keeps_model_dtype``): their outputs weigh
    experts.
    """

    keeps_model_dtype = ("router", "shared_expert_gate")

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config, self.settings = config, config.moe
        s = self.settings
        self.router = Linear(config.hidden_size, s.num_experts, bias=False)
        self.experts = GroupedExperts(s.num_experts, config.hidden_size, s.ffn, config.hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if s.shared_ffn is not None:
            self.shared_expert = GroupedExperts(1, config.hidden_size, s.shared_ffn, config.hidden_act)
            if s.shared_expert_gated:
                self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        # sigmoid routing's balancing bias: fp32 state without gradient, moved by each step's expert load
        # (features/expert_balance.py)
        self.register_buffer("expert_bias", None)
        if s.scoring == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(s.num_experts, dtype=torch.float32))
        self.exchange = run_experts
        self.sequence_sum = SequenceSum()
        self.auxiliary_share = 1.0
        self.record: RouterRecord | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.settings
        sequences, positions, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        logits = self.router(tokens).float().view(sequences, positions, -1)
        selection = None if self.expert_bias is None else Selection(self.expert_bias, s.n_group, s.topk_group,
                                                                     s.routed_scaling_factor)
        routing, self.record = route(logits, s.top_k, s.normalize_topk, s.capacity_factor, self.sequence_sum,
                                     selection)

        # Assignment rows in token order (each token's k copies side by side when nothing is dropped), then the
        # permutation that groups them by expert; the combine applies the inverse permutation and sums per token.
        top_k = s.top_k
        if routing.token_index is None:
            assigned = tokens.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, hidden)
        else:
            assigned = tokens.index_select(0, routing.token_index)
        order = routing.expert_index.argsort(stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        # A one-hot sum: an integer index_add_ falls back to a sorting kernel under torch.compile (11 ms a step).
        tokens_per_expert = F.one_hot(routing.expert_index, s.num_experts).sum(0)
        expert_out = self.exchange(self.experts, _Permute.apply(assigned, order, inverse), tokens_per_expert)
        weighted = _Permute.apply(expert_out, inverse, order) * routing.weight.unsqueeze(-1).to(expert_out.dtype)
        if routing.token_index is None:
            out = weighted.view(-1, top_k, hidden).sum(1)
        else:
            out = torch.zeros_like(tokens).index_add_(0, routing.token_index, weighted)
        if self.shared_expert is not None:
            every_token = torch.full((1,), tokens.shape[0], device=x.device)
            shared = self.shared_expert(tokens, every_token)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            out = out + shared
        return out.view_as(x)


class LlaMoEForCausalLM(LlamaForCausalLM):
    """Llama with ``MoEFeedForward`` blocks in every layer from ``moe_first_dense_layers`` on."""

    @staticmethod
    def feed_forward(config: LlaMoEConfig, index: int) -> nn.Module:
        return MoEFeedForward(config) if config.is_moe_layer(index) else LlamaMLP(config)


def moe_init_rule(name: str, config: LlamaConfig, std: float) -> Initializer:
    """Llama's rules; expert down projections (the shared expert's too) are residual outputs, scaled like
    ``down_proj.weight``."""
    if name.endswith(("experts.down_proj", "shared_expert.down_proj")):
        return normal(std / (2 * config.num_hidden_layers) ** 0.5)
    return llama_init_rule(name, config, std)


# --- the router's step term (``ModelSpec.step_terms``): auxiliary losses and statistics -----------------------------

def decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(global index, layer) of every decoder layer this stage holds: its ``layers``, then those of the modules a
    family keeps beside the head (``layers_beside_head``: DeepSeek-V3's multi-token prediction, numbered on from
    ``num_hidden_layers``)."""
    beside_head = getattr(model, "layers_beside_head", lambda: [])()
    return [(int(index), layer) for index, layer in model.layers.items()] + beside_head


def router_losses(model: LlamaForCausalLM, sequences_per_step: int, pooled: GlobalBalance | None = None
                  ) -> tuple[torch.Tensor | None, Statistics]:
    """The weighted auxiliary losses of the MoE blocks this stage holds, for its last forward (each the micro-batch's
    share of the step's mean over sequences and MoE layers; with ``pooled``, the balance loss's share of the
    global-batch loss instead), and their statistics; none for a dense model."""
    s = model.config.moe
    if s is None:
        return None, {}
    rows = {index: row for row, index in enumerate(s.layers)}
    scale = 1.0 / (len(rows) * sequences_per_step)
    loss, statistics = None, {}
    for index, layer in decoder_layers(model):
        block = layer.mlp
        if not isinstance(block, MoEFeedForward) or block.record is None:
            continue
        record, row = block.record, rows[int(index)]
        z = record.z * scale
        balance = record.balance * scale if pooled is None else pooled.loss(record.probabilities, row) / len(rows)
        if s.aux_loss_coef or s.z_loss_coef:
            term = (s.aux_loss_coef * balance + s.z_loss_coef * z) * block.auxiliary_share
            loss = term if loss is None else loss + term
        if not statistics:
            statistics = {name: torch.zeros(shape, device=record.z.device)
                          for name, shape in router_statistics_template(model.config).items()}
        if pooled is None:
            statistics["moe_load_balancing_loss"] = statistics["moe_load_balancing_loss"] + balance.detach()
        else:
            statistics["moe_router_probability"][row] = record.probabilities.detach()
        statistics["moe_z_loss"] = statistics["moe_z_loss"] + z.detach()
        statistics["moe_tokens_per_expert"][row] = record.tokens_per_expert
        statistics["moe_dropped"][row] = record.dropped
    return loss, statistics


def router_statistics_template(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The router's statistics; over the global batch, each layer's probability sums per expert replace the
    balance loss's sums (``moe_router_probability``), from which the metric is computed."""
    s = c.moe
    if s is None:
        return {}
    layers = len(s.layers)
    balance = {"moe_router_probability": (layers, s.num_experts)} if s.balance_scope == "global_batch" else {
        "moe_load_balancing_loss": ()}
    return balance | {"moe_z_loss": (), "moe_tokens_per_expert": (layers, s.num_experts), "moe_dropped": (layers,)}


def router_metrics(statistics: Statistics, c: LlamaConfig) -> dict:
    """Step metrics: the auxiliary losses (unweighted; over the global batch, the balance loss with the step's
    shares ``f``), and the expert load of each MoE layer: its busiest expert's tokens over the mean per expert (1.0
    is a perfect balance, E means one expert takes everything)."""
    if c.moe is None:
        return {}
    tokens = statistics["moe_tokens_per_expert"]
    load = (tokens.max(1).values / tokens.mean(1).clamp(min=1e-9)).tolist()
    if "moe_router_probability" in statistics:
        balance = balance_from_sums(tokens, statistics["moe_router_probability"], c.moe).mean()
    else:
        balance = statistics["moe_load_balancing_loss"]
    metrics = {"moe_load_balancing_loss": balance.item(),
               "moe_z_loss": statistics["moe_z_loss"].item(),
               "moe_max_expert_load": max(load), "moe_expert_load": load}
    if c.moe.capacity_factor is not None:
        metrics["moe_dropped_fraction"] = statistics["moe_dropped"].sum().item() / max(tokens.sum().item(), 1.0)
    return metrics


class RouterLosses:
    """A step term (``training/objective.py``) of a mixture of experts, on every pipeline stage: the weighted auxiliary
    losses of the MoE blocks the stage holds (``router_losses``), each micro-batch's share of the step's mean over
    its ``sequences_per_step`` sequences; their statistics, and the step's metrics (``router_metrics``). Over the
    global batch, the step's expert counts are pooled (``pooled``, ``pool``) before its first backward
    (``global_balance.py``)."""

    def __init__(self, config: LlamaConfig, sequences_per_step: int):
        self.config, self.sequences_per_step = config, sequences_per_step
        self.global_balance = GlobalBalance(config.moe) if config.moe.balance_scope == "global_batch" else None

    def template(self) -> dict[str, tuple[int, ...]]:
        return router_statistics_template(self.config)

    def compute(self, stage, batch) -> tuple[torch.Tensor | None, Statistics]:
        """``stage``: the stage's ``StageOutputs`` (its module's blocks hold their last forward's records)."""
        return router_losses(stage.module, self.sequences_per_step, self.global_balance)

    def pooled(self) -> dict[str, tuple[int, ...]]:
        if self.global_balance is None:
            return {}
        return {"moe_tokens_per_expert": router_statistics_template(self.config)["moe_tokens_per_expert"]}

    def pool(self, sums: Statistics) -> None:
        self.global_balance.pool(sums["moe_tokens_per_expert"])

    def metrics(self, sums: Statistics) -> dict:
        return router_metrics(sums, self.config)


def router_terms(config: Config) -> list[RouterLosses]:
    """The step terms of a run of a family whose layers may be mixtures of experts: the router's where there are."""
    model_config = config.model.model_config
    return [RouterLosses(model_config, config.global_batch_size)] if model_config.moe is not None else []
