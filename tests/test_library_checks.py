"""The library's public functions refuse bad input with one CorpError (issue 68): a model without
data, calibration images whose activations overflow, a string for a bool, the artifact constructor
called directly, non-finite weights saved, one module as both student and teacher."""

from __future__ import annotations

import copy

import pytest
import torch

from corp_deploy import (
    Artifact,
    CalibrationSpec,
    CompressConfig,
    RecoveryConfig,
    compress,
    compress_to_artifact,
    create_base_model,
    recover,
    recover_artifact,
    save_artifact,
)
from corp_deploy.errors import BadUsage, CorpError
from corp_deploy.stats import MomentAccumulator
from tests.helpers import SMALL_VIT_KWARGS

BASE_MODEL = {"name": "deit_tiny_patch16_224", "model_kwargs": SMALL_VIT_KWARGS}
ONE_STEP = RecoveryConfig(steps=1, batch_size=8)


@pytest.mark.parametrize(
    "emptied",
    [
        pytest.param(lambda model: model.to("meta"), id="meta-device"),
        pytest.param(lambda model: setattr(model, "head", torch.nn.LazyLinear(10)) or model, id="lazy-parameter"),
    ],
)
def test_a_model_without_data_is_refused_up_front_naming_the_tensor(vit, batches, emptied):
    with pytest.raises(CorpError, match=r"the model to compress: \S+ holds no data \((it is on the meta|it is a lazy)"):
        compress(emptied(vit), batches, CompressConfig(s_mlp=0.5))


@pytest.mark.parametrize(
    "settings, overflowed",
    [
        pytest.param(dict(s_mlp=0.5, s_attn=0.5), "the attention's queries and keys", id="corp"),
        pytest.param(dict(s_mlp=0.5, target="mlp"), "the MLP hidden activations", id="corp-mlp"),
        pytest.param(dict(macs=0.7), "the MLP hidden activations", id="corp-budget"),
        pytest.param(dict(method="vbp", s_mlp=0.5), "the MLP hidden activations", id="vbp"),
        pytest.param(dict(method="toast", s_mlp=0.5), "the MLP hidden activations", id="toast"),
    ],
)
def test_calibration_images_whose_activations_overflow_are_refused_before_any_solve(vit, batches, settings, overflowed):
    """Finite pixels of 1e30 overflow float32 in the first norm: the statistics are NaN, refused
    where they are first read (before torch's least squares fails on them, or a budget's Cholesky
    retries forever)."""
    huge = [images * 1e30 for images in batches]
    with pytest.raises(CorpError, match=f"the calibration activations overflowed: the sums of {overflowed} "):
        compress(vit, huge, CompressConfig.from_settings(**settings))


def test_moments_whose_float32_gram_overflows_are_refused_when_read():
    """Finite samples (1e20) whose squares exceed float32: the covariance is infinite."""
    moments = MomentAccumulator(4, activations="the probed activations")
    moments.update(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)) * 1e20)
    with pytest.raises(CorpError, match="overflowed: the sums of the probed activations over the calibration"):
        _ = moments.covariance


@pytest.mark.parametrize("flag", ["progress", "in_place"])
def test_compress_takes_only_bools_for_its_flags(vit, batches, flag):
    with pytest.raises(BadUsage, match=f"^{flag} must be True or False, not str$"):
        compress(vit, batches, CompressConfig(s_mlp=0.5), **{flag: "yes"})


@pytest.mark.parametrize("flag", ["progress", "in_place", "plots"])
def test_compress_to_artifact_takes_only_bools_for_its_flags(vit, tmp_path, flag):
    with pytest.raises(BadUsage, match=f"^{flag} must be True or False, not int$"):
        compress_to_artifact(vit, CompressConfig(s_mlp=0.5), CalibrationSpec(samples=8), tmp_path / "out", **{flag: 1})
    assert not list(tmp_path.iterdir())


def test_save_artifact_takes_only_a_bool_for_plots(vit, tmp_path):
    with pytest.raises(BadUsage, match="^plots must be True or False, not str$"):
        save_artifact(vit, tmp_path / "art", base_model=BASE_MODEL, plots="no")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("pretrained", ["no", 0])
def test_create_base_model_takes_only_a_bool_for_pretrained(pretrained):
    """``pretrained="no"`` counted as true: a download of pretrained weights where none were asked for."""
    with pytest.raises(BadUsage, match=f"^pretrained must be True or False, not {type(pretrained).__name__}$"):
        create_base_model("deit_tiny", SMALL_VIT_KWARGS, pretrained=pretrained)


def test_recover_artifact_takes_only_a_bool_for_progress(tiny_artifact, tmp_path):
    with pytest.raises(BadUsage, match="^progress must be True or False, not str$"):
        recover_artifact(tiny_artifact, ONE_STEP, tmp_path / "recovered", progress="no")
    assert not list(tmp_path.iterdir())


def test_recover_takes_only_a_bool_for_progress(vit, batches):
    with pytest.raises(BadUsage, match="^progress must be True or False, not str$"):
        recover(copy.deepcopy(vit), vit, batches, ONE_STEP, progress="no")


def test_the_artifact_constructor_points_to_artifact_read(tiny_artifact):
    with pytest.raises(BadUsage, match=r"Artifact\(\.\.\.\) is not called directly: .* Artifact\.read\(path\)"):
        Artifact(tiny_artifact)
    artifact = Artifact.read(tiny_artifact)
    assert artifact.path == tiny_artifact and artifact.checksums is not None


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_save_artifact_refuses_non_finite_weights_naming_them_writing_nothing(vit, tmp_path, value):
    with torch.no_grad():
        vit.blocks[1].mlp.fc1.weight[3, 5] = value
    with pytest.raises(CorpError, match=r"^the model to save: blocks\.1\.mlp\.fc1\.weight holds NaN or infinite"):
        save_artifact(vit, tmp_path / "art", base_model=BASE_MODEL)
    assert not list(tmp_path.iterdir())  # neither the artifact nor its staging folder


def test_recover_refuses_one_module_as_student_and_teacher(vit, batches):
    before = {key: value.clone() for key, value in vit.state_dict().items()}
    with pytest.raises(BadUsage, match="^student and teacher are the same module"):
        recover(vit, vit, batches, ONE_STEP)
    assert all(torch.equal(value, before[key]) for key, value in vit.state_dict().items())


def test_recover_refuses_a_student_that_trains_a_tensor_of_the_teacher(vit, batches):
    student = copy.deepcopy(vit)
    student.blocks[0].mlp.fc1.weight = vit.blocks[0].mlp.fc1.weight
    with pytest.raises(BadUsage, match=r"share the tensor of the student's blocks\.0\.mlp\.fc1\.weight"):
        recover(student, vit, batches, ONE_STEP)
