"""ToaSt, one-shot (docs/method.md §5): coupled per-head attention pruning ranked by distance to
the geometric median, and token channel selection for the FFN. No fine-tuning and no
compensation: kept weights are copied unchanged.

Attention (timm layout: fused ``qkv`` ``[q | k | v]`` head-major, ``proj`` ``(dim, H*d)``).
Head ``h``, dim ``j`` has two coupled weight vectors, each a point in ``R^(2*dim)``:
``[Wq[h, j], Wk[h, j]]`` (the same index leaves the query and the key, so ``q . k`` stays a
sum over the kept indices) and ``[Wv[h, j], Wproj[:, h*d + j]]`` (value channel ``j`` is only
read by proj column ``h*d + j``). Per head and per pair, ``I[j] = ||w_j - GM||``, ``GM`` the
geometric median of the head's ``d`` points; the dims nearest the median are the most
replaceable and are removed; every head keeps the same ``d'`` of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import channels
from ..blocks import block_forward
from ..dims import kept_count
from ..errors import CorpError, SettingError, check_setting_types
from ..families import blocks_of, is_plain_attention, token_groups
from ..layers import PrunedAttention, block_dims, head_dims
from ..models import uses_class_token
from ..stats import MLP_HIDDEN, check_finite_sums
from .base import BlockRun, CompressSettings, Method, MethodOptions, option


@dataclass(frozen=True)
class ToastOptions(MethodOptions):
    """ToaSt's settings. ``token_fraction``: fraction of each image's patch tokens sampled for the
    FFN channel importance (ToaSt uses 2-20%)."""

    token_fraction: float = option(0.1, "fraction of patch tokens per image sampled for FFN channel importance.")

    def __post_init__(self) -> None:
        check_setting_types(self)
        if not 0.0 < self.token_fraction <= 1.0:
            raise SettingError(f"{{setting}} must be in (0, 1], got {self.token_fraction!r}", "token_fraction")


class Toast(Method):
    name = "toast"
    summary = "geometric-median head-dim pruning and token channel selection for the FFN."
    prunes = "MLP hidden channels and attention query/key and value dims"
    targets = ("mlp", "attn", "both")
    default_target = "both"
    options_class = ToastOptions
    has_compensation = False

    def check_model(self, model: nn.Module, config: CompressSettings) -> None:
        for groups in (token_groups(block) for block in blocks_of(model)):
            if not groups.in_place:
                raise CorpError(
                    f"toast samples tokens of a token sequence and is not implemented for {groups.description}; "
                    "use --method corp or vbp"
                )
        if config.prunes_mlp and uses_class_token(model):
            for block in model.blocks:
                if not is_plain_attention(block.attn):
                    raise CorpError(
                        "toast's FFN channel selection weights tokens by the class token's attention, "
                        f"which needs timm's plain Attention; this model has {type(block.attn).__name__}"
                    )

    def compress_blocks(self, model: nn.Module, run: BlockRun, config: CompressSettings) -> list[dict]:
        """FFN channels by token channel selection on the dense block's activations; query/key and
        value/proj dims by distance to each head's geometric median (weights only)."""
        class_token = uses_class_token(model)
        sampler = torch.Generator().manual_seed(0)  # token samples: reproducible
        layers = []
        for block in blocks_of(model):
            info: dict = {}
            if config.prunes_mlp:
                importance = TokenChannelImportance(
                    block.mlp.fc1.out_features,
                    model.num_prefix_tokens,
                    class_token,
                    config.options.token_fraction,
                    sampler,
                )
                with run.timer("block_statistics"):
                    _advance_with_importance(block, run, importance)
                with run.timer("mlp_solve"):
                    kept = kept_count(block.mlp.fc1.out_features, config.s_mlp, config.round_to)
                    S, P = channels.split_channels(importance.scores, kept)
                    channels.fold_mlp(block.mlp, S, P)
                info["mlp"] = {"hidden": kept}
            # (attention only: the ranking reads weights, so the calibration tokens need not move on)
            if config.prunes_attn:
                with run.timer("attention_solve"):
                    kept = kept_count(head_dims(block.attn)[0], config.s_attn, config.round_to)
                    qk, v = head_dim_importance(block.attn)
                    block.attn = prune_heads(block.attn, top_dims(qk, kept), top_dims(v, kept))
                info["attention"] = {"qk_head_dim": kept, "v_head_dim": kept}
            info["dims"] = block_dims(block).to_dict()
            layers.append(info)
            run.block_done()
        return layers


def _advance_with_importance(block: nn.Module, run: BlockRun, importance: TokenChannelImportance) -> None:
    """Move ``run.cache`` through the dense ``block``, adding each batch to ``importance`` (with the
    class token's attention row, taken from the block's own queries and keys, when it uses one)."""
    scale = block.attn.scale if importance.class_token else None
    attention_rows: list[torch.Tensor] = []

    def on_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        attention_rows.append(class_token_attention(q, k, scale))

    def on_hidden(h: torch.Tensor) -> None:
        importance.update(h, attention_rows.pop() if importance.class_token else None)

    run.cache.advance(
        lambda x: block_forward(block, x, on_heads=on_heads if importance.class_token else None, on_hidden=on_hidden)
    )


def geometric_median(points: torch.Tensor, max_iter: int = 1000, tol: float = 1e-12) -> torch.Tensor:
    """The point minimising the sum of Euclidean distances to ``points`` ``(n, k)``; ``(k,)`` float64.

    Weiszfeld's iteration from the mean, with Vardi & Zhang's step when the iterate lands on
    a data point (plain Weiszfeld divides by zero there, and stalls at a point that is not
    the median). Stops when a step moves less than ``tol`` times the points' scale.
    """
    x = points.double()
    y = x.mean(0)
    scale = float((x - y).norm(dim=1).max()) or 1.0
    for _ in range(max_iter):
        dist = (x - y).norm(dim=1)
        at_point = dist <= 1e-14 * scale
        w = 1.0 / dist[~at_point]
        others = x[~at_point]
        if len(others) == 0:
            return y
        weiszfeld = (w[:, None] * others).sum(0) / w.sum()
        if at_point.any():  # Vardi-Zhang: move off the data point only if that lowers the sum
            pull = (w[:, None] * (others - y)).sum(0).norm()
            eta = float(at_point.sum())
            if pull <= eta:
                return y
            step = eta / float(pull)
            new = (1.0 - step) * weiszfeld + step * y
        else:
            new = weiszfeld
        moved = float((new - y).norm())
        y = new
        if moved <= tol * scale:
            break
    return y


def median_distances(points: torch.Tensor) -> torch.Tensor:
    """ToaSt importance ``I[j] = ||w_j - GM||`` of each row ``w_j`` of ``points`` ``(n, k)``."""
    return (points.double() - geometric_median(points)).norm(dim=1)


def head_dim_importance(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance of every query/key dim and every value dim of timm ``Attention``.

    Returns ``(qk, v)``, each ``(H, d)`` float64 (see the module docstring).
    """
    H, d = attn.num_heads, head_dims(attn)[0]
    dim = attn.qkv.in_features
    w = attn.qkv.weight.detach().double().reshape(3, H, d, dim)
    proj = attn.proj.weight.detach().double().T.reshape(H, d, dim)  # proj column h*d + j as a row
    qk = torch.stack([median_distances(torch.cat([w[0, h], w[1, h]], dim=1)) for h in range(H)])
    v = torch.stack([median_distances(torch.cat([w[2, h], proj[h]], dim=1)) for h in range(H)])
    return qk, v


def top_dims(scores: torch.Tensor, kept: int) -> torch.Tensor:
    """Per head the ``kept`` highest-scoring dims, ``(H, kept)`` long, each row ascending."""
    return torch.argsort(scores, dim=1, descending=True, stable=True)[:, :kept].sort(dim=1).values


def prune_heads(attn: nn.Module, qk_kept: torch.Tensor, v_kept: torch.Tensor) -> PrunedAttention:
    """Slice timm ``Attention`` to the kept query/key dims ``(H, d_qk)`` and value dims
    ``(H, d_v)`` of every head, value rows and proj columns together; the original softmax
    scale is kept. Weights keep their dtype and device."""
    H, d = attn.num_heads, head_dims(attn)[0]
    heads = torch.arange(H, device=qk_kept.device)[:, None] * d
    q_rows = (heads + qk_kept).reshape(-1)
    v_rows = (heads + v_kept).reshape(-1)
    rows = torch.cat([q_rows, H * d + q_rows, 2 * H * d + v_rows])
    qkv, proj = attn.qkv, attn.proj
    new = PrunedAttention.replacing(attn, qk_kept.shape[1], v_kept.shape[1])
    with torch.no_grad():
        new.qkv.weight.copy_(qkv.weight[rows])
        if qkv.bias is not None:
            new.qkv.bias.copy_(qkv.bias[rows])
        new.proj.weight.copy_(proj.weight[:, v_rows])
        if proj.bias is not None:
            new.proj.bias.copy_(proj.bias)
    return new


def class_token_attention(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """How much the class token (token 0) attends to each token, given an attention layer's
    queries and keys ``(B, H, N, d)`` and its softmax scale: its softmax row averaged over
    heads, ``(B, N)``."""
    logits = torch.einsum("bhd,bhnd->bhn", q[:, :, 0], k) * scale
    return logits.softmax(-1).mean(1)


class TokenChannelImportance:
    """FFN hidden-channel importance from a random sample of each image's patch tokens.

    Per image, with ``x`` the post-activation hidden states ``(N, H)`` and a sample ``T`` of
    ``max(1, round(fraction * patches))`` patch tokens:

    * class-token models: ``I_c = 2.0 |x_cls,c| + 1.0 mean_{i in T}(A_cls,i |x_i,c|)``,
      ``A_cls`` the class token's attention row (heads averaged);
    * otherwise: ``I_c = mean_{i in T} |x_i,c|``.

    ``scores`` is the mean over calibration images (a static, per-model selection).
    """

    CLASS_WEIGHT, SAMPLE_WEIGHT = 2.0, 1.0

    def __init__(
        self, hidden: int, num_prefix_tokens: int, class_token: bool, fraction: float, generator: torch.Generator
    ) -> None:
        self.num_prefix_tokens = num_prefix_tokens
        self.class_token = class_token
        self.fraction = fraction
        self.generator = generator
        self.images = 0
        self._sum = torch.zeros(hidden, dtype=torch.float64)

    def update(self, hidden: torch.Tensor, class_attention: torch.Tensor | None) -> None:
        """``hidden`` ``(B, N, H)``; ``class_attention`` ``(B, N)`` (class-token models)."""
        B, N, _ = hidden.shape
        patches = N - self.num_prefix_tokens
        count = max(1, round(self.fraction * patches))
        picks = torch.rand(B, patches, generator=self.generator).argsort(dim=1)[:, :count]
        picks = (picks + self.num_prefix_tokens).to(hidden.device)
        sampled = hidden.abs().gather(1, picks[..., None].expand(-1, -1, hidden.shape[-1]))
        if self.class_token:
            weights = class_attention.gather(1, picks)[..., None]
            scores = self.CLASS_WEIGHT * hidden[:, 0].abs() + self.SAMPLE_WEIGHT * (weights * sampled).mean(1)
        else:
            scores = sampled.mean(1)
        self._sum += scores.double().sum(0).cpu()
        self.images += B

    @property
    def scores(self) -> torch.Tensor:
        """``(H,)`` float64, the mean importance over the images seen, checked to be finite
        (:func:`~corp_deploy.stats.check_finite_sums`)."""
        check_finite_sums(MLP_HIDDEN, self._sum)
        return self._sum / max(self.images, 1)
