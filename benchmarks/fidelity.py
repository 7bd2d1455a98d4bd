"""Fidelity of a compressed model against its dense base (what ``bench`` reports); by default
it is measured on :func:`corp_deploy.calibration.held_out_images`."""

from __future__ import annotations

import torch
from torch import nn

from corp_deploy.metrics import kl_divergence_sum, tensor_cosine, top1_matches


@torch.no_grad()
def features_and_logits(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled final features (before the classifier) and outputs of a timm ViT, ``(B, D)`` and
    ``(B, classes)``; for a model without a classifier both are the pooled features."""
    tokens = model.forward_features(images)
    return model.forward_head(tokens, pre_logits=True), model.forward_head(tokens)


class FidelityMeter:
    """Compressed-vs-dense fidelity accumulated over batches of held-out images.

    Always: mean cosine of the final pooled features. With a classifier: top-1 agreement with
    the dense model and the mean KL divergence ``KL(p_dense || p_compressed)`` of the softmax
    outputs (float64). With labels: top-1 / top-5 accuracy of both models.
    """

    def __init__(self, classifier: bool) -> None:
        self.classifier = classifier
        self.images = 0
        self.sums: dict[str, float] = {"cosine": 0.0, "agree": 0.0, "kl": 0.0}
        self.correct: dict[str, dict[str, float]] | None = None

    def update(
        self,
        dense: tuple[torch.Tensor, torch.Tensor],
        compressed: tuple[torch.Tensor, torch.Tensor],
        labels: torch.Tensor | None = None,
    ) -> None:
        """``dense`` and ``compressed``: ``(features, logits)`` of the same images."""
        (fd, ld), (fc, lc) = dense, compressed
        self.images += len(fd)
        self.sums["cosine"] += float(tensor_cosine(fd.double(), fc.double()).sum())
        if self.classifier:
            self.sums["agree"] += float(top1_matches(ld, lc).sum())
            self.sums["kl"] += float(kl_divergence_sum(ld, lc))
        if labels is not None and self.classifier:
            if self.correct is None:
                self.correct = {m: {"top1": 0.0, "top5": 0.0} for m in ("dense", "compressed")}
            for name, logits in (("dense", ld), ("compressed", lc)):
                top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
                self.correct[name]["top1"] += float((top[:, 0] == labels).sum())
                self.correct[name]["top5"] += float((top == labels[:, None]).any(-1).sum())

    def result(self) -> dict:
        n = max(self.images, 1)
        out = {
            "images": self.images,
            "feature_cosine": self.sums["cosine"] / n,
            "top1_agreement": self.sums["agree"] / n if self.classifier else None,
            "kl_mean": self.sums["kl"] / n if self.classifier else None,
            "accuracy": None,
        }
        if self.correct is not None:
            out["accuracy"] = {m: {k: v / n for k, v in c.items()} for m, c in self.correct.items()}
        return out
