"""Error curves: for every prunable unit of a model, the compensated error at every kept size,
from dense calibration statistics (docs/method.md §8).

Units: the MLP of each block (kept hidden channels), the query/key dims of each block and the
value/output dims of each block (kept dims per head, the same in every head). All errors are in
one currency, the mean squared error a unit adds to the residual stream per token:

* MLP and values: in closed form, the ridge objective of the nested kept sets of the selection
  order (:func:`corp_deploy.channels.prefix_objective`) through the consumer's residual-stream
  weight (LayerScale included);
* query/key: the exact logit objective of the nested kept sets of every head, in closed form
  (:func:`.qk_pruning.head_curve`), converted into residual-stream error by
  measurement: at a few sizes (:func:`qk_probe_sizes`) the compensated attention is built from
  the same factorisation and run on the first :data:`PROBE_IMAGES` calibration images, and the
  ratio of its measured output error to the logit error is interpolated between those sizes
  (log-linear in the kept size). The softmax makes this ratio depend on the layer and on the size
  (measured on DINOv2: 0.1 to 10), so no closed form stands in for it.

``distortion`` is what the allocation compares (lab/RESULTS.md measures the choices):
``residual`` divides each error by the energy of the residual stream where the unit writes into
it (the scale the next LayerNorm removes), ``normed`` weighs error and energy per channel by the
gain of the norm that next reads the stream and takes the energy where that norm reads it,
``relative`` divides by the unit's own error at full pruning, ``absolute`` leaves it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ... import channels, distributed
from ...blocks import BoundaryCache, attention_output, block_exit, mlp_residual, residual_weight
from ...families import blocks_of, token_groups
from ...layers import GatedLinear, head_dims
from ...parts import PARTS
from ...stats import MLP_HIDDEN, PROJ_INPUTS, MomentAccumulator
from ..base import CompressSettings
from . import qk_pruning
from .qk_statistics import HeadGrams, QKSums


@dataclass
class UnitCurve:
    """One prunable unit and its error at every kept size ``0..total``.

    ``part``: ``mlp`` (``total`` hidden channels), ``qk`` or ``vo`` (``total`` = head dim, kept
    dims per head in every head), or ``qkvo`` (query/key and value tied to the same count).
    ``macs_per_dim``: MACs one kept dim costs (for head dims: that dim in every head).
    ``error``: ``(total + 1,)`` float64, residual-stream MSE per token; ``distortion`` the same
    made comparable across units. ``orders``: the selection orders the curve was computed for
    (``mlp`` hidden channels, ``vo`` proj-input channels, ``qk`` ``(H, d)`` head dims per head;
    prefixes are the kept sets), and ``qk_solutions``: every head's query/key solution at every
    kept size ``1..d`` (from the curve's factorisation), so that compression from the same
    statistics keeps the same sets and compensations without selecting or solving again.
    """

    block: int
    part: str
    total: int
    macs_per_dim: int
    error: torch.Tensor
    distortion: torch.Tensor
    orders: dict[str, torch.Tensor] = field(default_factory=dict)
    qk_solutions: dict[int, list[qk_pruning.HeadSolution]] = field(default_factory=dict)

    def tied_with(self, other: UnitCurve) -> UnitCurve:
        """Query/key and value/output of one block as one unit (``equal_head_dims``)."""
        return UnitCurve(
            self.block,
            "qkvo",
            self.total,
            self.macs_per_dim + other.macs_per_dim,
            self.error + other.error,
            self.distortion + other.distortion,
            {**self.orders, **other.orders},
            self.qk_solutions or other.qk_solutions,
        )


def macs_per_dim(part: str, tokens: int, block: nn.Module) -> int:
    """MACs of one kept dim of ``block``'s ``part`` per image, as :func:`corp_deploy.count_macs`
    counts them, for width ``C`` and ``N`` tokens (a Swin block counts its own feature map's tokens).

    MLP hidden channel: fc1 and fc2 (``2 N C``; ``3 N C`` for a gated MLP, whose fc1 has a
    gate and an up row per channel). Query/key dim in every head: the query and key
    rows of qkv (``2 N C``) and the logits matmul (``N K``, ``K`` keys per query: ``N``, or the
    window's tokens). Value dim in every head: the value row of qkv (``N C``), the
    attention-values matmul (``N K``) and the proj column (``N C``). Within windows, attention sees
    the feature map padded to whole windows.
    """
    width, heads = block.attn.proj.out_features, block.attn.num_heads
    mlp_tokens, attention_tokens, keys = token_groups(block).counts(tokens)
    if part == "mlp":
        return (3 if isinstance(block.mlp.fc1, GatedLinear) else 2) * mlp_tokens * width
    return heads * (2 * attention_tokens * width + attention_tokens * keys)


class ResidualEnergy:
    """Mean over tokens of ``||gain * (x - mean_c(x))||^2``, the residual stream's energy as a
    LayerNorm with affine ``gain`` ``(C,)`` sees it (None: ones)."""

    def __init__(self, gain: torch.Tensor | None = None) -> None:
        self.total, self.tokens = 0.0, 0
        self.gain = gain

    def update(self, x: torch.Tensor) -> None:
        centred = x - x.mean(-1, keepdim=True)
        if self.gain is not None:
            centred = centred * self.gain.to(x.dtype)
        self.total += float(centred.square().sum(-1).double().sum())
        self.tokens += x[..., 0].numel()

    def all_reduce(self) -> None:
        """Sum over the ranks of torch.distributed (no-op in one process)."""
        self.total, self.tokens = distributed.sum_floats(self.total, self.tokens)

    @property
    def value(self) -> float:
        return self.total / max(self.tokens, 1)


def unit_shapes(model: nn.Module, tokens: int, parts: tuple[str, ...]) -> list[tuple[int, int]]:
    """``(total, macs_per_dim)`` of every unit of ``parts`` (``mlp``, ``qk``, ``vo``), block by block."""
    return [
        (part.total(block), macs_per_dim(part.name, tokens, block))
        for block in blocks_of(model)
        for part in PARTS.values()
        if part.name in parts
    ]


#: Calibration images on which the query/key error is measured (the first ones).
PROBE_IMAGES = 32


def qk_probe_sizes(head_dim: int) -> tuple[int, ...]:
    """Kept query/key dims at which the attention's output error is measured: ``d/8 .. 7d/8``."""
    return tuple(sorted({k for k in (round(head_dim * j / 8) for j in range(1, 8)) if 0 < k < head_dim}))


def measure_curves(
    model: nn.Module, cache: BoundaryCache, config: CompressSettings, block_done=lambda: None
) -> list[UnitCurve]:
    """One pass of the dense ``model`` over ``cache`` (advanced to the model's output): the
    curves of every unit of the parts ``config`` prunes, in block order (``mlp``, ``qk``, ``vo``
    per block, or ``qkvo`` instead of the last two with ``equal_head_dims``)."""
    units: list[UnitCurve] = []
    tokens, options = cache.tokens, config.options
    blocks = blocks_of(model)
    for index, block in enumerate(blocks):
        attn, heads = block.attn, block.attn.num_heads
        grams = HeadGrams() if "qk" in config.parts else None
        proj_inputs = (
            MomentAccumulator(attn.proj.in_features, cache.device, track_positive=False, activations=PROJ_INPUTS)
            if "vo" in config.parts
            else None
        )
        hidden = (
            MomentAccumulator(
                block.mlp.fc1.out_features,
                cache.device,
                track_positive=options.ranker == "active",
                activations=MLP_HIDDEN,
            )
            if "mlp" in config.parts
            else None
        )
        normed = options.distortion == "normed"  # energies where the next norms read the stream, weighted as they do
        attn_gain, mlp_gain = _next_norm_gains(model, blocks, index) if normed else (None, None)
        attn_energy, mlp_energy = ResidualEnergy(attn_gain), ResidualEnergy(mlp_gain)
        probe: list[torch.Tensor] = []  # the inputs of the calibration set's first PROBE_IMAGES images
        offsets = iter(cache.image_offsets())

        def step(x: torch.Tensor) -> torch.Tensor:
            if grams is not None:
                probe.append(x[: max(0, PROBE_IMAGES - next(offsets))].clone())
            if not normed:
                attn_energy.update(x)
            x = x + block.ls1(
                attention_output(
                    block,
                    block.norm1(x),
                    grams.add if grams is not None else None,
                    proj_inputs.update if proj_inputs is not None else None,
                )
            )
            (attn_energy if normed else mlp_energy).update(x)
            x = mlp_residual(block, x, hidden.update if hidden is not None else None)
            if normed:
                mlp_energy.update(x)
            return block_exit(block, x)

        cache.advance(step)
        for statistics in (grams, proj_inputs, hidden):
            if statistics is not None:
                statistics.all_reduce()
        attn_energy.all_reduce()
        mlp_energy.all_reduce()
        block_units = {}
        if hidden is not None:
            w = residual_weight(block.mlp.fc2, block.ls2)
            order = channels.keep_order(hidden, w, options.ranker, options.ridge)
            error = channels.prefix_objective(hidden, _gained(w, mlp_gain), order, options.ridge)
            block_units["mlp"] = _unit(index, block, "mlp", error, mlp_energy.value, tokens, options.distortion, order)
        if grams is not None:
            error, order, solutions = _qk_curve(block, grams, torch.cat(probe), options.ridge, attn_gain)
            block_units["qk"] = _unit(index, block, "qk", error, attn_energy.value, tokens, options.distortion, order)
            block_units["qk"].qk_solutions = solutions
        if proj_inputs is not None:
            w = residual_weight(attn.proj, block.ls1)
            order = channels.keep_order(proj_inputs, w, options.ranker, options.ridge, groups=heads)
            error = channels.prefix_objective(proj_inputs, _gained(w, attn_gain), order, options.ridge)[::heads]
            block_units["vo"] = _unit(index, block, "vo", error, attn_energy.value, tokens, options.distortion, order)
        if options.equal_head_dims:
            block_units["qk"] = block_units["qk"].tied_with(block_units.pop("vo"))
        units += block_units.values()
        block_done()
    return units


def _next_norm_gains(
    model: nn.Module, blocks: list[nn.Module], index: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The affine gains ``(C,)`` float64 of the norms that next read what block ``index``'s
    attention and MLP write (its ``norm2``; the next block's ``norm1``, or the model's final
    ``norm`` after the last block); None where that is not a norm of the stream's width with a
    per-channel weight (e.g. across a Swin patch merging, or a model pooled before its norm)."""
    block = blocks[index]
    width = block.attn.proj.out_features
    after_mlp = blocks[index + 1].norm1 if index + 1 < len(blocks) else getattr(model, "norm", None)

    def gain(norm: nn.Module | None) -> torch.Tensor | None:
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.shape != (width,):
            return None
        return weight.detach().double()

    return gain(block.norm2), gain(after_mlp)


def _gained(weight: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """``diag(gain) weight``: a consumer's residual-stream weight as the next norm weighs it."""
    return weight if gain is None else gain.to(weight)[:, None] * weight


def _qk_curve(
    block: nn.Module, grams: HeadGrams, probe: torch.Tensor, alpha: float, gain: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[int, list[qk_pruning.HeadSolution]]]:
    """The query/key unit's residual-stream error for every kept size ``0..d`` (module docstring):
    the summed logit curves of the heads, times the measured ratio of output to logit error; the
    heads' ranked dims ``(H, d)``; and every head's solution at every kept size ``1..d``.
    ``probe``: block inputs ``(B, N, C)`` of the probe images (under torch.distributed: those this
    rank holds, maybe none; the errors are summed over the ranks); ``gain`` ``(C,)``: weighs the
    output error per channel (None: ones)."""
    attn, head_dim = block.attn, head_dims(block.attn)[0]
    sums = grams.heads()
    orders = torch.argsort(qk_pruning.qk_dim_scores(sums), dim=1, descending=True, stable=True)
    sizes = qk_probe_sizes(head_dim)
    curves, by_size = _head_curves(sums, orders, alpha)
    logit = attn.scale**2 * curves.sum(0).cpu()
    del sums
    dense_output = block.ls1(attention_output(block, block.norm1(probe))) if len(probe) else None
    gain = probe.new_ones(()) if gain is None else gain.to(probe)
    ratios = {}
    for k in sizes:
        total = tokens = 0.0
        if dense_output is not None:  # this rank holds probe images
            pruned = qk_pruning.fold_attention(attn, orders[:, :k].sort(dim=1).values, [s.M for s in by_size[k]])
            error = (block.ls1(attention_output(block, block.norm1(probe), attn=pruned)) - dense_output) * gain
            total, tokens = float(error.double().square().sum()), error[..., 0].numel()
        total, tokens = distributed.sum_floats(total, tokens)
        measured = total / tokens
        if measured > 0 and logit[k] > 0:
            ratios[k] = measured / float(logit[k])
    if not ratios:  # no logit error at any probe size: nothing to convert
        return logit, orders, by_size
    log_ratio = np.interp(np.arange(head_dim + 1), list(ratios), np.log(list(ratios.values())))
    return logit * torch.from_numpy(np.exp(log_ratio)), orders, by_size


def _head_curves(
    sums: list[QKSums], orders: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, dict[int, list[qk_pruning.HeadSolution]]]:
    """Every head's logit curve ``(H, d + 1)`` and its solution at every kept size ``1..d``
    (:func:`~.qk_pruning.head_curve`; ``sums``: the heads' query/key sums, ``orders``
    ``(H, d)``). Under torch.distributed rank ``r`` factorises the heads ``h = r mod world size``
    and the results are summed over the ranks (zeros elsewhere: exact), so every rank holds all of them."""
    heads, d = len(sums), orders.shape[1]
    zeros = dict(dtype=torch.float64, device=orders.device)
    curves = torch.zeros(heads, d + 1, **zeros)
    matrices = torch.zeros(heads, sum(k * k for k in range(1, d + 1)), **zeros)  # every M_k flattened, k = 1..d
    numbers = torch.zeros(heads, d, 4, **zeros)  # per k: ridge lambda, sliced and compensated errors, energy
    for h in range(distributed.rank(), heads, distributed.world_size()):
        curves[h], solutions = qk_pruning.head_curve(sums[h], orders[h], alpha, solutions_at=range(1, d + 1))
        matrices[h] = torch.cat([solutions[k].M.reshape(-1) for k in range(1, d + 1)])
        numbers[h] = curves.new_tensor(
            [
                [s.ridge_lambda, s.error_uncompensated, s.error_compensated, s.logit_energy]
                for s in (solutions[k] for k in range(1, d + 1))
            ]
        )
    for shared in (curves, matrices, numbers):
        distributed.all_reduce_sum(shared)
    by_size, start = {}, 0
    for k in range(1, d + 1):
        by_size[k] = [
            qk_pruning.HeadSolution(
                matrices[h, start : start + k * k].reshape(k, k).clone(), *numbers[h, k - 1].tolist()
            )
            for h in range(heads)
        ]
        start += k * k
    return curves, by_size


def _unit(
    index: int,
    block: nn.Module,
    part: str,
    error: torch.Tensor,
    residual_energy: float,
    tokens: int,
    distortion: str,
    order: torch.Tensor | None = None,
) -> UnitCurve:
    error = error.double().cpu()
    scale = {"residual": residual_energy, "normed": residual_energy, "relative": float(error[0]), "absolute": 1.0}[
        distortion
    ]
    return UnitCurve(
        index,
        part,
        len(error) - 1,
        macs_per_dim(part, tokens, block),
        error,
        error / scale if scale > 0 else torch.zeros_like(error),
        {part: order} if order is not None else {},
    )
