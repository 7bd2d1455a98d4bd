"""Error curves: for every prunable unit of a model, the compensated output error at every kept
size, in closed form from dense calibration statistics (docs/method.md §8).

Units: the MLP of each block (kept hidden channels), the query/key dims of each block and the
value/output dims of each block (kept dims per head, the same in every head). All errors are in
one currency, the mean squared error a unit adds to the residual stream per token:

* MLP and values: the ridge objective of the nested kept sets of the selection order
  (:func:`corp_deploy.channels.prefix_objective`) through the consumer's residual-stream weight
  (LayerScale included);
* query/key: the exact logit objective of every head (:func:`corp_deploy.attention.head_curve`)
  times the head's measured first-order sensitivity of its output to logit errors
  (:class:`LogitSensitivity`).

``distortion`` is what the allocation compares: ``residual`` divides each error by the energy
of the residual stream where the unit writes into it (the scale the next LayerNorm removes),
``relative`` by the unit's own error at full pruning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import attention as attn_ops
from . import channels
from .blocks import BoundaryCache, attention_forward, mlp_residual, residual_weight
from .stats import HeadGrams, MomentAccumulator

if TYPE_CHECKING:
    from .config import CompressConfig


@dataclass
class UnitCurve:
    """One prunable unit and its error at every kept size ``0..total``.

    ``part``: ``mlp`` (``total`` hidden channels), ``qk`` or ``vo`` (``total`` = head dim, kept
    dims per head in every head), or ``qkvo`` (query/key and value tied to the same count).
    ``macs_per_dim``: MACs one kept dim costs (for head dims: that dim in every head).
    ``error``: ``(total + 1,)`` float64, residual-stream MSE per token; ``distortion`` the same
    made comparable across units.
    """

    block: int
    part: str
    total: int
    macs_per_dim: int
    error: torch.Tensor
    distortion: torch.Tensor

    def tied_with(self, other: "UnitCurve") -> "UnitCurve":
        """Query/key and value/output of one block as one unit (``equal_head_dims``)."""
        return UnitCurve(self.block, "qkvo", self.total, self.macs_per_dim + other.macs_per_dim,
                         self.error + other.error, self.distortion + other.distortion)


def macs_per_dim(part: str, tokens: int, width: int, heads: int) -> int:
    """MACs of one kept dim of ``part`` per image, as :func:`corp_deploy.count_macs` counts them.

    MLP hidden channel: fc1 and fc2 (``2 N C``). Query/key dim in every head: the query and key
    rows of qkv (``2 N C``) and the logits matmul (``N^2``). Value dim in every head: the value
    row of qkv (``N C``), the attention-values matmul (``N^2``) and the proj column (``N C``).
    """
    per_head = 2 * tokens * width + tokens * tokens
    return {"mlp": 2 * tokens * width, "qk": heads * per_head, "vo": heads * per_head}[part]


class LogitSensitivity:
    """How much a head's output in the residual stream moves per unit of logit error.

    For row ``i`` of a head, ``delta o_i = sum_j p_ij delta_l_ij (u_j - u_bar_i)`` to first
    order (softmax Jacobian), ``u_j`` value ``j`` mapped into the residual stream (output
    projection columns of the head, LayerScale included) and ``u_bar_i = sum_j p_ij u_j``. For
    logit errors spread evenly over the ``N^2`` entries of an image,
    ``sum_i ||delta o_i||^2 = ||delta L||^2 K / N^2`` with ``K = sum_ij p_ij^2 ||u_j - u_bar_i||^2``.
    ``kappa`` is the mean of ``K / N^3`` over images: per-token residual MSE per unit of
    per-image squared (scaled) logit error.
    """

    def __init__(self, attn: nn.Module, layer_scale: nn.Module) -> None:
        H, d = attn.num_heads, attn.head_dim
        w = residual_weight(attn.proj, layer_scale).float().reshape(-1, H, d)  # (C, H, d)
        self.metric = torch.einsum("chd,che->hde", w, w)  # W_h^T diag(gamma^2) W_h, (H, d, d)
        self.scale = attn.scale
        self.total = torch.zeros(H, dtype=torch.float64)
        self.images = 0

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One batch of per-head queries, keys and values ``(B, H, N, d)``."""
        N = q.shape[2]
        p = (self.scale * q @ k.transpose(-1, -2)).softmax(-1)
        p2 = p.square()
        v_bar = p @ v
        metric = self.metric.to(v.device)
        norm_u = torch.einsum("bhnd,hde,bhne->bhn", v, metric, v)
        term = (p2 @ norm_u[..., None])[..., 0] - 2.0 * torch.einsum("bhnd,hde,bhne->bhn", p2 @ v, metric, v_bar) \
            + torch.einsum("bhnd,hde,bhne->bhn", v_bar, metric, v_bar) * p2.sum(-1)
        self.total += (term.sum(-1).double() / N ** 3).sum(0).cpu()
        self.images += q.shape[0]

    @property
    def kappa(self) -> torch.Tensor:
        """``(H,)`` float64."""
        return self.total / max(self.images, 1)


class ResidualEnergy:
    """Mean over tokens of ``||x - mean_c(x)||^2``, the residual stream's energy as LayerNorm sees it."""

    def __init__(self) -> None:
        self.total, self.tokens = 0.0, 0

    def update(self, x: torch.Tensor) -> None:
        self.total += float((x - x.mean(-1, keepdim=True)).square().sum(-1).double().sum())
        self.tokens += x.shape[0] * x.shape[1]

    @property
    def value(self) -> float:
        return self.total / max(self.tokens, 1)


def measure_curves(model: nn.Module, cache: BoundaryCache, config: "CompressConfig",
                   block_done=lambda: None) -> list[UnitCurve]:
    """One pass of the dense ``model`` over ``cache`` (advanced to the model's output): the
    curves of every unit of the parts ``config`` prunes, in block order (``mlp``, ``qk``, ``vo``
    per block, or ``qkvo`` instead of the last two with ``equal_head_dims``)."""
    units: list[UnitCurve] = []
    tokens = cache.tokens
    for index, block in enumerate(model.blocks):
        attn, width, heads = block.attn, block.attn.proj.out_features, block.attn.num_heads
        grams = HeadGrams() if "qk" in config.parts else None
        sensitivity = LogitSensitivity(attn, block.ls1) if grams is not None else None
        proj_inputs = MomentAccumulator(attn.proj.in_features, cache.device, track_positive=False) \
            if "vo" in config.parts else None
        hidden = MomentAccumulator(block.mlp.fc1.out_features, cache.device, track_positive=config.ranker == "active") \
            if "mlp" in config.parts else None
        attn_energy, mlp_energy = ResidualEnergy(), ResidualEnergy()

        def on_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            grams.add(q, k)
            sensitivity.update(q, k, v)

        def step(x: torch.Tensor) -> torch.Tensor:
            attn_energy.update(x)
            x = x + block.ls1(attention_forward(attn, block.norm1(x), on_heads if grams is not None else None,
                                                proj_inputs.update if proj_inputs is not None else None))
            mlp_energy.update(x)
            return mlp_residual(block, x, hidden.update if hidden is not None else None)

        cache.advance(step)
        block_units = {}
        if hidden is not None:
            w = residual_weight(block.mlp.fc2, block.ls2)
            order = channels.keep_order(hidden, w, config.ranker, config.ridge)
            error = channels.prefix_objective(hidden, w, order, config.ridge)
            block_units["mlp"] = _unit(index, "mlp", error, mlp_energy.value, tokens, width, heads, config)
        if grams is not None:
            a_full, g_full = grams.head_major()
            scores = attn_ops.qk_dim_scores(a_full.transpose(0, 1), g_full.transpose(0, 1))
            orders = torch.argsort(scores, dim=1, descending=True, stable=True)
            logit = torch.stack([attn_ops.head_curve(a_full[h], g_full[h], orders[h], config.ridge)
                                 for h in range(heads)])  # (H, d + 1), unscaled
            error = (sensitivity.kappa[:, None] * attn.scale ** 2 * logit).sum(0)
            block_units["qk"] = _unit(index, "qk", error, attn_energy.value, tokens, width, heads, config)
        if proj_inputs is not None:
            w = residual_weight(attn.proj, block.ls1)
            order = channels.keep_order(proj_inputs, w, config.ranker, config.ridge, groups=heads)
            error = channels.prefix_objective(proj_inputs, w, order, config.ridge)[::heads]
            block_units["vo"] = _unit(index, "vo", error, attn_energy.value, tokens, width, heads, config)
        if config.equal_head_dims:
            block_units["qk"] = block_units["qk"].tied_with(block_units.pop("vo"))
        units += block_units.values()
        block_done()
    return units


def _unit(block: int, part: str, error: torch.Tensor, residual_energy: float, tokens: int, width: int,
          heads: int, config: "CompressConfig") -> UnitCurve:
    error = error.double().cpu()
    scale = residual_energy if config.distortion == "residual" else float(error[0])
    return UnitCurve(block, part, len(error) - 1, macs_per_dim(part, tokens, width, heads), error,
                     error / scale if scale > 0 else torch.zeros_like(error))
