"""Label-free recovery: a short distillation of the compressed model from the dense one it was
compressed from, on the same unlabelled calibration images (docs/method.md §11).

The compressed model (the student, its dims fixed) is trained to reproduce the dense model (the
teacher) block by block: the loss is the mean over blocks of ``1 - cosine`` between the student's
and the teacher's residual stream after the block, per token, plus ``final_weight`` times the same
for the final features (``forward_features``; 0 by default: measured, the blocks alone generalise
better). Only the blocks learn, and the final norm when the final features are in the loss; the
embeddings and the head stay as they are (so the teacher can be checked against the student: their
patch embeddings must be equal). AdamW, a linear warmup and a cosine decay. Each step trains on
fresh augmented views of the calibration images' files (:class:`RecoveryImages`: crops and flips;
colour distortions and mixup where asked for): the images compression was fitted on are matched
closely already, and views it has not seen carry the signal. The weights measured and kept are a
blend, ``blend`` of the trained change added to compression's (as WiSE-FT interpolates fine-tuned
weights; 1 by default: all of it): trained on a few images, the student gains on images like them
and loses on others, and a blend below 1 keeps most of the first and gives back the second.

A share of the images' sources is held out for validation, from training and from compression
(:meth:`RecoveryImages.fit_batches`): unseen views of them (at least :data:`VALIDATION_VIEWS` in
all), as they are and distorted in colour and sharpness. The student is measured on both before the
first step and every ``eval_every`` steps (the mean cosine of the model's outputs, pooled features
or logits, to the teacher's). A measurement counts as better when it beats the best so far on the
views as they are (by more than :data:`MIN_GAIN`, float rounding) without falling below compression
on the distorted ones; recovery stops when ``patience`` measurements in a row were not better, and
the weights of the best are kept, CORP's own if none was: a recovery never leaves the model worse
on either validation set than compression left it, and one that kept no step leaves the model
exactly as compression on all the images makes it (:func:`corp_deploy.compress` compresses again
on :attr:`RecoveryImages.batches`).

Under torch.distributed the student is wrapped in ``DistributedDataParallel``: every process draws
the same global batch and runs its share of it, torch averages the gradients, so the result equals
one process's up to the order of float sums.
"""

from .config import MAX_BATCH, MAX_STEPS, SETTING_PREFIX, TRAINED, RecoveryConfig
from .images import DECODED_BYTES, VALIDATION_VIEWS, RecoveryImages, check_sources
from .loop import recover
from .loss import Outputs, check_teacher, distillation_loss
from .report import recovery_table
from .training import _Distillation as _Distillation
from .training import trainable_parameters
from .validation import MIN_GAIN

__all__ = [
    "DECODED_BYTES",
    "MAX_BATCH",
    "MAX_STEPS",
    "MIN_GAIN",
    "SETTING_PREFIX",
    "TRAINED",
    "VALIDATION_VIEWS",
    "Outputs",
    "RecoveryConfig",
    "RecoveryImages",
    "check_sources",
    "check_teacher",
    "distillation_loss",
    "recover",
    "recovery_table",
    "trainable_parameters",
]
