"""Mixture of experts: the MLP of a sparse layer (Qwen3-MoE, Mixtral, OLMoE), beside model.py's dense one.

A sparse layer holds ``num_experts`` gated MLPs (the experts) and a router, a linear layer that
scores every expert for each token. A token goes through only the ``top_k`` experts it scores
highest, and the layer's output is their outputs summed, each weighted by the router's probability
for it. A model of 128 experts of which 8 run holds 16 times the MLP weights any one token computes
with: Qwen3-30B-A3B has 30B parameters and spends about 3B a token.

One step's tokens, ``[num_tokens, hidden]``, go through ``FusedMoE.forward`` in four moves:

1. route: logits ``[num_tokens, num_experts]``, their softmax in float32, the top k of it (HF's
   ``torch.topk``, so ties fall as they fall for HF), renormalized to sum to 1 where the family says.
2. permute: the ``num_tokens * top_k`` (token, expert) pairs sorted by expert (a stable sort: each
   expert's tokens stay in token order), so that each expert's tokens are one contiguous run of rows.
3. grouped matmuls: each run times its expert's weights, gate and up fused in one matrix as the
   dense MLP fuses them (``gate_up_proj``), SiLU(gate) * up, then ``down_proj``.
4. unpermute: each row back to its (token, slot) place, and a token's k rows summed, weighted.

Why permute. Taken pair by pair, each (token, expert) is a matrix-vector product that reads the
expert's whole weight for one token. Sorted by expert, each expert is one matrix-matrix product
over all its tokens, reading its weight once for all of them; and the runs lie back to back in one
buffer, with offsets, which is what a fused-MoE kernel (vLLM's ``fused_moe``, a grouped GEMM) takes
to do every expert in one launch. Here a loop over the experts that got tokens stands for that one
launch: readable, and an expert with no tokens costs nothing.

Why decode over experts is bound by memory in its own way. A dense MLP's decode step reads all of
its weights once, however many sequences the batch holds: a larger batch reuses each byte more. A
sparse layer's step reads the weights of every expert the batch's tokens picked: k experts for one
token, up to min(num_experts, batch * k) for a batch, so the bytes a step reads grow with the batch
until every expert is touched (Qwen3-30B-A3B: 8 of 128 experts at batch 1, most of them by batch
32), and batching buys much less reuse than in a dense model until then.

With tensor parallelism each expert's intermediate features are split over the ranks as the dense
MLP's are (linear.py): every rank routes every token the same way (the router is whole on each),
computes its share of each picked expert's features, and the partial sums out of ``down_proj`` are
all-reduced once for the whole layer.

With ``quantization`` each expert's two weights are quantized as a ``Linear``'s are
(quantization.py), expert by expert, and each run's product is the quantized kernel's.

The per-expert token counts are read into Python (the loop's bounds), so no graph, CUDA or CPU,
could replay a step through this layer: model_runner.py decodes MoE models eagerly.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine import cpu_kernels, quantization
from nanoengine.activation import SiluAndMul
from nanoengine.model_families import MoESpec
from nanoengine.parallel import Shard, TensorParallelGroup


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts ``[num_tokens, top_k]`` (highest first) and their weights, in
    float32, picked as HF's routers pick them: softmax over all experts in float32, ``torch.topk``,
    and the k weights divided by their sum if ``renormalize`` (Mixtral always; Qwen3-MoE and OLMoE
    where ``norm_topk_prob``), else left as parts of the softmax over all experts."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def permute(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs sorted by expert: ``order[r]`` is the pair (flattened, token * top_k +
    slot) that row r of the sorted batch holds; ``counts[e]`` is how many rows expert e's run has."""
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()


def grouped_matmul(x: torch.Tensor, experts: "Experts", leaf: str, counts: list[int]) -> torch.Tensor:
    """Rows ``x`` sorted by expert, ``counts[e]`` of them expert e's, each run times its expert's
    weight ``leaf`` (``Experts.matmul``): what a grouped GEMM does in one launch."""
    out = x.new_empty(x.shape[0], experts.out_features[leaf])
    start = 0
    for expert, n in enumerate(counts):
        if n:
            out[start:start + n] = experts.matmul(leaf, expert, x[start:start + n])
            start += n
    return out


def fused_moe(x: torch.Tensor, experts: "Experts", weights: torch.Tensor, expert_ids: torch.Tensor,
              act: nn.Module) -> torch.Tensor:
    """The experts' weighted sum for each token of x ``[num_tokens, hidden]``, routed already
    (``weights``, ``expert_ids``: ``route``). In bf16 a token's k rows are summed in one rounding,
    where HF rounds after adding each expert's."""
    num_tokens, top_k = expert_ids.shape
    order, counts = permute(expert_ids, experts.num_experts)
    sorted_x = x[order // top_k]  # pair p is token p // top_k's
    hidden = act(grouped_matmul(sorted_x, experts, "gate_up_proj", counts))
    sorted_out = grouped_matmul(hidden, experts, "down_proj", counts)
    out = torch.empty_like(sorted_out)
    out[order] = sorted_out  # back in (token, slot) order
    return (out.view(num_tokens, top_k, -1) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)


class Experts(nn.Module):
    """The experts' weights, stacked: ``gate_up_proj`` ``[num_experts, 2 * intermediate, hidden]``
    (each expert's gate rows, then its up rows) and ``down_proj`` ``[num_experts, hidden,
    intermediate]``, ``intermediate`` being this rank's ``shard`` of the features."""

    quantized = False

    def __init__(self, hidden_size: int, num_experts: int, shard: Shard):
        super().__init__()
        self.shard, self.num_experts = shard, num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * shard.size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, shard.size))
        self.out_features = {"gate_up_proj": 2 * shard.size, "down_proj": hidden_size}

    def matmul(self, leaf: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x times expert ``expert``'s weight ``leaf``, as ``F.linear`` (or the quantized kernel) takes it."""
        if self.quantized:
            scales = getattr(self, f"{leaf}_scales")
            return cpu_kernels.quantized_linear(x, getattr(self, f"{leaf}_qweight")[expert],
                                                None if scales is None else scales[expert], None,
                                                self.out_features[leaf])
        return F.linear(x, getattr(self, leaf)[expert])

    def quantize(self, fmt: str) -> None:
        """As ``Linear.quantize``, an expert at a time: each weight becomes ``{leaf}_qweight`` and
        ``{leaf}_scales`` (None for int4), stacked over the experts, and the float weights are dropped.
        Shapes the kernel does not take (``quantization.can_quantize``) keep their float weights."""
        shapes = [tuple(getattr(self, leaf).shape[1:]) for leaf in self.out_features]
        if not all(quantization.can_quantize(*shape) for shape in shapes):
            return
        for leaf in self.out_features:
            parts = [quantization.quantize_weight(w, fmt) for w in getattr(self, leaf).detach()]
            self.register_parameter(leaf, None)
            self.register_buffer(f"{leaf}_qweight", torch.stack([q for q, _ in parts]))
            self.register_buffer(f"{leaf}_scales", None if fmt == "int4" else torch.stack([s for _, s in parts]))
        self.quantized = True

    def checkpoint_shards(self, leaf: str) -> list[tuple[str, tuple[int, str]]]:
        """For the loader: the checkpoint tensors that fill parameter ``leaf`` (their names after this
        module's, each with its shard id): HF checkpoints hold each expert's projections apart."""
        projections = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        return [(f"{expert}.{projection}.weight", (expert, projection))
                for expert in range(self.num_experts) for projection in projections]

    def checkpoint_part(self, leaf: str, shard_id: tuple[int, str]):
        """For the loader, as linear.py's layers say it: the checkpoint tensor's shape, the part this
        rank holds (its rows of gate and up, its columns of down), and the view of ``leaf`` it fills."""
        expert, projection = shard_id
        shard, param = self.shard, getattr(self, leaf).data[expert]
        features = slice(shard.start, shard.start + shard.size)
        if projection == "down_proj":
            return (param.shape[0], shard.total), (slice(None), features), param
        offset = 0 if projection == "gate_proj" else shard.size
        return (shard.total, param.shape[1]), (features,), param[offset:offset + shard.size]


class FusedMoE(nn.Module):
    """A sparse layer's MLP: the router ``gate`` (HF's name; whole on every rank, and a plain
    ``nn.Linear``, so never quantized or repacked: the routing is HF's) and the ``experts``."""

    def __init__(self, hidden_size: int, spec: MoESpec, tp: TensorParallelGroup | None):
        super().__init__()
        self.top_k, self.renormalize, self.tp = spec.top_k, spec.renormalize, tp
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(hidden_size, spec.num_experts, Shard.split(spec.intermediate_size, tp))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        out = fused_moe(x, self.experts, weights, expert_ids, self.act)
        return out if self.tp is None else self.tp.all_reduce(out)
