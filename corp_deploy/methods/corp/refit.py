"""The drift-correcting refit (docs/method.md §10): after CORP compresses a block, its consumer
layers (``attn.proj``, ``mlp.fc2``) are refitted by ridge regression from the inputs the block
receives in the *compressed* model to the outputs of the *dense* model, shrunk toward CORP's
solution, so that each block corrects the error the compressed blocks before it let through.

Per consumer layer with compressed-path input ``h`` (``k`` channels) and target ``t`` (the dense
residual after the sub-block minus the compressed residual before it, LayerScale divided out:
the dense branch's output plus the drift of the stream, divided by the LayerScale):

    min_{W, b} E||gamma * (t - W h - b)||^2 + lambda ||W - W0||^2,
    lambda = alpha * mean(gamma^2) * tr(Cov(h)) / k,

that is, row by row, ``W'_o^T = (Cov(h) + lambda_o I)^-1 (Cov(h, t_o) + lambda_o W0_o^T)`` with
``lambda_o = lambda / gamma_o^2`` and ``b' = E[t] - W' E[h]``: ``W0`` the CORP-compensated weight,
``gamma`` the LayerScale (ones without one), ``alpha`` the refit's shrinkage (``--refit-shrink``).
The statistics are one joint :class:`~corp_deploy.stats.MomentAccumulator` of ``[h, t]``.

The compressed path is a second :class:`~corp_deploy.blocks.BoundaryCache` that starts at the
embedding and is advanced through every block once it is compressed and refitted; what the dense
block computes is kept from its statistics pass (:class:`DenseTargets`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...blocks import BoundaryCache, attention_output, block_exit, block_forward, mlp_hidden, mlp_residual
from ...channels import add_ridge_, spd_solve
from ...errors import CorpError
from ...families import check_prunable, token_groups
from ...stats import MomentAccumulator

#: ``--refit`` values: which consumer layers are refitted.
REFIT_LAYERS = {"none": (), "fc2": ("fc2",), "proj+fc2": ("proj", "fc2")}


class DenseTargets:
    """The refit's targets for one block, formed per calibration batch while the dense block runs
    (:meth:`add`), from its input ``x_d``, attention branch ``a_d`` and MLP branch ``m_d`` (both before
    their LayerScales ``gamma1``, ``gamma2``) and the compressed path's input ``x_c`` of the same batch,
    each ``(B, N, C)``:

    * ``proj``: ``a_d + (x_d - x_c) / gamma1`` (kept only when ``attn.proj`` is refitted);
    * ``fc2``: ``m_d + ((x_d - x_c) + gamma1 a_d) / gamma2`` (kept only when ``mlp.fc2`` is
      refitted), from which ``fc2``'s target is formed by subtracting ``gamma1 a_c / gamma2`` once
      the compressed attention's output ``a_c`` is known.

    At most two tensors per batch, formed from branches and the difference of the two paths'
    inputs: no ``mid - x`` of two large residuals, whose rounding a small LayerScale would magnify
    (what is left, float32 rounding of ``gamma1 a / gamma2``, is of the branch's size). ``gamma1``,
    ``gamma2``: ``(C,)``, the LayerScales with zeros replaced by ones (ones without one)."""

    def __init__(self, block: nn.Module, path: BoundaryCache, with_proj: bool, with_fc2: bool) -> None:
        self._block, self._path = block, iter(path.batches)
        self.gamma1 = _layer_scale(block.ls1, path.batches[0])
        self.gamma2 = _layer_scale(block.ls2, path.batches[0])
        self.proj: list[torch.Tensor] | None = [] if with_proj else None
        self.fc2: list[torch.Tensor] | None = [] if with_fc2 else None

    def add(self, x: torch.Tensor, attention: torch.Tensor, mlp: torch.Tensor) -> None:
        drift = x - next(self._path)
        if self.proj is not None:
            self.proj.append(attention + drift / self.gamma1)
        if self.fc2 is not None:
            self.fc2.append(mlp + (drift + self._block.ls1(attention)) / self.gamma2)


@dataclass(frozen=True)
class RefitSolution:
    """A refitted consumer ``h @ W.T + b`` (float64) and its calibration error before and after in
    the residual stream, ``E||gamma * (t - W h - b)||^2`` per token for CORP's layer and for the
    refit, relative to ``E||gamma * t||^2``."""

    weight: torch.Tensor
    bias: torch.Tensor
    relative_error_before: float
    relative_error_after: float


def solve_refit(
    joint: MomentAccumulator,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    alpha: float,
    gamma: torch.Tensor | None = None,
) -> RefitSolution:
    """The shrunk ridge refit from the statistics of ``[h, t]`` (``joint``, ``k + out`` dims):
    ``weight`` ``(out, k)`` and ``bias`` (None: zero) are ``W0``, ``b0``; ``alpha`` the shrinkage;
    ``gamma`` ``(out,)`` the LayerScale that multiplies the layer's output (None: ones).

    Minimises the error in the residual stream, ``E||gamma * (t - W h - b)||^2``, plus
    ``lambda ||W - W0||^2`` with ``lambda = alpha * mean(gamma^2) * tr(Cov(h)) / k``: row ``o`` is a
    ridge regression with ``lambda_o = lambda / gamma_o^2``, so a row whose output hardly reaches the
    stream stays near ``W0`` (without a LayerScale, or with equal gammas, one solve serves all
    rows; else one eigendecomposition of ``Cov(h)``). Rows with ``gamma_o = 0`` stay ``W0``, ``b0``.
    """
    k = weight.shape[1]
    cov, mean = joint.covariance, joint.mean
    cov_h, cov_ht, mean_h, mean_t = cov[:k, :k], cov[:k, k:], mean[:k], mean[k:]
    w0 = weight.double()
    b0 = bias.double() if bias is not None else torch.zeros_like(mean_t)
    g2 = torch.ones_like(mean_t) if gamma is None else gamma.double().square()
    reach = g2 > 0
    lam = alpha * float(g2.mean()) * float(torch.trace(cov_h)) / max(k, 1)
    row_lam = lam / torch.where(reach, g2, torch.ones_like(g2))  # (out,)
    rhs = cov_ht + row_lam * w0.T  # (k, out)
    if bool((row_lam == row_lam[0]).all()):
        w = spd_solve(add_ridge_(cov_h.clone(), float(row_lam[0])), rhs).T
    else:
        evals, basis = torch.linalg.eigh(cov_h)
        w = (basis @ ((basis.T @ rhs) / (evals[:, None] + row_lam))).T
    w = torch.where(reach[:, None], w, w0)
    b = torch.where(reach, mean_t - w @ mean_h, b0)
    cov_t = torch.diagonal(cov[k:, k:])
    energy = float((g2 * (cov_t + mean_t.square())).sum())

    def error(w_: torch.Tensor, b_: torch.Tensor) -> float:
        per_row = cov_t - 2 * (w_ * cov_ht.T).sum(1) + ((w_ @ cov_h) * w_).sum(1) + (mean_t - w_ @ mean_h - b_).square()
        return float((g2 * per_row).sum()) / energy if energy else 0.0

    return RefitSolution(w, b, error(w0, b0), error(w, b))


def _refitted(layer: nn.Linear, solution: RefitSolution) -> nn.Linear:
    """A copy of ``layer`` (same shape, device, dtype) with the refitted weight and a bias."""
    new = nn.Linear(
        layer.in_features, layer.out_features, bias=True, device=layer.weight.device, dtype=layer.weight.dtype
    )
    with torch.no_grad():
        new.weight.copy_(solution.weight)
        new.bias.copy_(solution.bias)
    return new


def _layer_scale(scale: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """The LayerScale ``gamma`` a residual branch is multiplied by (ones without one; zeros,
    whose rows do not reach the stream, replaced by ones so that the target stays finite)."""
    gamma = getattr(scale, "gamma", None)
    if gamma is None:
        return torch.ones(like.shape[-1], dtype=like.dtype, device=like.device)
    gamma = gamma.detach().to(like.dtype)
    return torch.where(gamma == 0, torch.ones_like(gamma), gamma)


#: The part whose pruning needs the structure a consumer's refit reads (probes that see the
#: consumer's input as it computes it: no talking heads before ``proj``, no norm before ``fc2``).
_CONSUMER_PART = {"proj": "vo", "fc2": "mlp"}


class DriftRefit:
    """The compressed model's path through the calibration set, and the refit of each block.

    Args:
        model: the model being compressed (dense), to see which consumers can be refitted: those
            whose part :func:`~corp_deploy.families.check_prunable` admits.
        cache: the hidden states entering the first block (copied: the compressed path).
        layers: which consumers to refit (a value of :data:`REFIT_LAYERS`).
        alpha: the shrinkage toward CORP's solution.
    """

    def __init__(self, model: nn.Module, cache: BoundaryCache, layers: tuple[str, ...], alpha: float) -> None:
        self.path = cache.clone()
        self.layers = tuple(layer for layer in layers if _admits(model, _CONSUMER_PART[layer]))
        self.alpha = alpha

    def targets(self, block: nn.Module) -> DenseTargets:
        """An empty :class:`DenseTargets` of ``block`` (dense), to be filled by its statistics pass."""
        return DenseTargets(block, self.path, self._refits_proj(block), "fc2" in self.layers)

    def _refits_proj(self, block: nn.Module) -> bool:
        # attention within groups (Swin's windows): proj's input does not line up with the stream's tokens
        return "proj" in self.layers and token_groups(block).in_place

    def refit_block(self, block: nn.Module, targets: DenseTargets) -> dict:
        """Refit ``block``'s consumers (compressed, in place) toward ``targets``, then advance the
        compressed path through the refitted block; returns the report of each refitted layer."""
        report, proj_inputs = {}, None
        if self._refits_proj(block):
            report["proj"], proj_inputs = self._refit_proj(block, targets)
        if "fc2" in self.layers:
            report["fc2"] = self._refit_fc2(block, targets, proj_inputs)  # leaves the path after the attention
            self.path.advance(lambda x: block_exit(block, mlp_residual(block, x)))
        else:
            self.path.advance(lambda x: block_forward(block, x))
        return report

    def _refit_proj(self, block: nn.Module, targets: DenseTargets) -> tuple[dict, list[torch.Tensor]]:
        """Target: the dense attention branch plus the drift of the block's input, ``a_d + (x_d - x_c) / gamma1``.
        Returns the report and, per batch, the input ``(B, N, k)`` of ``proj`` on the compressed path
        (it does not depend on ``proj``: the attention need not run again after the refit)."""
        attn = block.attn
        joint = MomentAccumulator(
            attn.proj.in_features + attn.proj.out_features,
            self.path.device,
            track_positive=False,
            activations="the refitted output projection's inputs and targets",
        )
        inputs: list[torch.Tensor] = []
        for x in self.path.batches:
            attention_output(block, block.norm1(x), on_proj_input=inputs.append)
            joint.update(inputs[-1], targets.proj.pop(0))  # each target is used once
        joint.all_reduce()
        solution = solve_refit(joint, attn.proj.weight, attn.proj.bias, self.alpha, getattr(block.ls1, "gamma", None))
        attn.proj = _refitted(attn.proj, solution)
        return _report(solution), inputs

    def _refit_fc2(self, block: nn.Module, targets: DenseTargets, proj_inputs: list[torch.Tensor] | None) -> dict:
        """Target: the dense MLP branch plus the drift after the attention,
        ``m_d + ((x_d - x_c) + gamma1 (a_d - a_c)) / gamma2``. Moves the compressed path to after the
        block's (refitted) attention. ``proj_inputs``: per batch, the input of ``attn.proj`` on the
        compressed path, when known (None: the attention is run)."""
        fc2 = block.mlp.fc2
        joint = MomentAccumulator(
            fc2.in_features + fc2.out_features,
            self.path.device,
            track_positive=False,
            activations="the refitted fc2's inputs and targets",
        )

        def through_attention(x: torch.Tensor) -> torch.Tensor:
            a = attention_output(block, block.norm1(x)) if proj_inputs is None else block.attn.proj(proj_inputs.pop(0))
            a = block.ls1(a)
            joint.update(mlp_hidden(block, x + a), targets.fc2.pop(0) - a / targets.gamma2)
            return x + a

        self.path.advance(through_attention)
        joint.all_reduce()
        solution = solve_refit(joint, fc2.weight, fc2.bias, self.alpha, getattr(block.ls2, "gamma", None))
        block.mlp.fc2 = _refitted(fc2, solution)
        return _report(solution)


def _admits(model: nn.Module, part: str) -> bool:
    try:
        check_prunable(model, (part,))
    except CorpError:
        return False
    return True


def _report(solution: RefitSolution) -> dict:
    return {
        "relative_error_before": solution.relative_error_before,
        "relative_error_after": solution.relative_error_after,
    }
