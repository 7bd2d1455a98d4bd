"""The compress workflow (one home for the CLI, sweep and library), the calibration spec, the part
records, and the joint sparsity setting."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from corp_deploy import (
    CalibrationImages,
    CalibrationSpec,
    CompressConfig,
    ImagesInMemory,
    compress,
    compress_to_artifact,
    load_compressed,
    model_transform,
)
from corp_deploy.cli.group import option_name
from corp_deploy.errors import CorpError, SettingError
from corp_deploy.methods.corp.sizes import BlockSizes, uniform_sizes
from corp_deploy.parts import PARTS, TARGET_PARTS, UNIT_PARTS
from tests.helpers import SMALL_VIT_KWARGS

#: The record of the small ViT's dense model, as the CLI would write it.
BASE_MODEL = {"name": "deit_tiny_patch16_224", "model_kwargs": SMALL_VIT_KWARGS}


@pytest.fixture
def spec():
    return CalibrationSpec(samples=8, batch_size=4, seed=3)


def test_compress_to_artifact_writes_what_compress_computes(small_vit, spec, tmp_path):
    """The artifact holds the model ``compress`` makes from the spec's images, and records the
    config's settings beside the calibration's."""
    config = CompressConfig(s_mlp=0.5, s_attn=0.25)
    result = compress_to_artifact(small_vit(), config, spec, tmp_path / "art", base_model=BASE_MODEL)
    transform, _ = model_transform(small_vit())
    images = CalibrationImages.from_builtin(transform, count=8, batch_size=4, seed=3)
    expected, report = compress(small_vit(), images, config)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(load_compressed(result.path).state_dict()[name], tensor), name
    settings = json.loads((tmp_path / "art" / "config.json").read_text())["settings"]
    assert settings == {**config.to_dict(), "calib_samples": 8, "batch_size": 4, "seed": 3, "calib_crops": True}
    assert result.calibration == images.summary() and result.calibration["images_used"] == 8
    assert result.report["macs"] == report["macs"] and result.calibration_warnings() == []


def test_images_read_once_give_the_same_artifact(small_vit, spec, tmp_path):
    config = CompressConfig(s_mlp=0.5)
    transform, _ = model_transform(small_vit())
    held = ImagesInMemory(spec.images(transform))
    once = compress_to_artifact(small_vit(), config, spec, tmp_path / "a", base_model=BASE_MODEL, images=held)
    again = compress_to_artifact(small_vit(), config, spec, tmp_path / "b", base_model=BASE_MODEL)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert once.calibration == again.calibration


def test_the_workflow_refuses_work_that_does_not_fit_in_memory(small_vit, spec, tmp_path, monkeypatch):
    monkeypatch.setattr("corp_deploy.resources.available_bytes", lambda: 1)
    with pytest.raises(CorpError, match="needs at least .* GiB of memory"):
        compress_to_artifact(small_vit(), CompressConfig(), spec, tmp_path / "art", base_model=BASE_MODEL)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize(
    "fields, setting, option",
    [
        (dict(samples=0), "samples", "--calib-samples"),
        (dict(batch_size=-1), "batch_size", "--batch-size"),
        (dict(samples=2.5), "samples", "--calib-samples"),
        (dict(seed=2**32), "seed", "--seed"),
    ],
)
def test_a_bad_calibration_spec_names_its_setting(fields, setting, option):
    with pytest.raises(SettingError) as raised:
        CalibrationSpec(**fields)
    assert raised.value.settings == (setting,) and raised.value.naming(option_name).startswith(option)


def test_the_joint_sparsity_fills_every_part_without_its_own():
    config = CompressConfig(sparsity=0.3, s_attn=0.2, target="all")
    assert (config.s_mlp, config.s_attn, config.s_vo) == (0.3, 0.2, 0.3)
    assert config == CompressConfig(s_mlp=0.3, s_attn=0.2, s_vo=0.3, target="all")
    assert "sparsity" not in config.to_dict()  # recorded per part
    assert CompressConfig().s_mlp == CompressConfig(sparsity=None).s_mlp == 0.5


def test_from_dict_reads_back_an_artifacts_settings():
    config = CompressConfig.from_settings(macs=0.6, ridge=0.1, target="all")
    assert CompressConfig.from_dict({**config.to_dict(), "calib_samples": 8, "batch_size": 4, "seed": 3}) == config
    vbp = CompressConfig(method="vbp", s_mlp=0.2)
    assert CompressConfig.from_dict(vbp.to_dict()) == vbp


@pytest.mark.parametrize("given", [dict(sparsity=0.5), dict(s_vo=0.5), dict(sparsity=0.4, s_mlp=0.5)])
def test_a_budget_with_sparsities_is_a_conflict_naming_what_was_given(given):
    with pytest.raises(SettingError, match="exclude each other") as raised:
        CompressConfig.from_settings(macs=0.6, **given)
    named = tuple(name for name in ("sparsity", "s_mlp", "s_attn", "s_vo") if name in given)
    assert raised.value.settings == named and raised.value.exit_code == 2
    options = ", ".join(option_name(name) for name in named)  # "--s" for the joint one
    assert raised.value.naming(option_name).startswith(f"a MAC budget and sparsities ({options}) exclude")


def test_a_joint_sparsity_out_of_range_is_named_as_the_command_line_names_it():
    with pytest.raises(SettingError) as raised:
        CompressConfig(sparsity=1.5)
    assert raised.value.naming(option_name) == "--s must be in [0, 1), got 1.5"


def test_part_records_agree_with_the_config_the_sizes_and_the_blocks(small_vit):
    """Every part's setting is a sparsity field of the config, its size fields are BlockSizes
    fields, its total is what the block has, and every target names known parts."""
    config_fields = {field.name for field in dataclasses.fields(CompressConfig)}
    size_fields = {field.name for field in dataclasses.fields(BlockSizes)}
    block = small_vit().blocks[0]
    heads = block.attn.num_heads
    totals = {"mlp": block.mlp.fc1.out_features, "qk": block.attn.qkv.out_features // 3 // heads}
    totals["vo"] = totals["qk"]
    for part in PARTS.values():
        assert part.setting in config_fields and part.option == option_name(part.setting)
        assert set(part.size_fields) <= size_fields
        assert part.total(block) == totals[part.name]
    assert set(UNIT_PARTS["qkvo"].size_fields) == {"qk", "v"}
    assert all(set(parts) <= set(PARTS) for parts in TARGET_PARTS.values())


def test_uniform_sizes_set_the_fields_of_the_pruned_parts_only(small_vit):
    block = small_vit().blocks[0]
    sizes = uniform_sizes(block, CompressConfig(s_mlp=0.5, s_vo=0.25, target="mlp-vo"))
    assert (sizes.mlp, sizes.qk, sizes.v) == (block.mlp.fc1.out_features // 2, None, 12)


def test_an_empty_output_path_is_refused_as_such_not_taken_for_the_current_directory(small_vit, spec):
    from corp_deploy.errors import BadUsage

    with pytest.raises(BadUsage, match="out_dir is empty: an empty path names no file or folder"):
        compress_to_artifact(small_vit(), CompressConfig(), spec, "", base_model=BASE_MODEL)


@pytest.mark.parametrize("given", [None, {"name": "deit_tiny_patch16_224", "model_kwargs": {"img_size": 32}}])
def test_a_base_model_record_that_cannot_rebuild_the_model_is_refused_before_the_work(
    small_vit, spec, tmp_path, monkeypatch, given
):
    """Inferred (only the image size and classes) or given, a record that does not rebuild the
    model is refused before any image is read or compressed, not when the artifact is saved."""

    def never(*args, **kwargs):
        raise AssertionError("the work started")

    monkeypatch.setattr("corp_deploy.workflow.compress", never)
    monkeypatch.setattr(CalibrationSpec, "images", never)
    expected = "cannot tell how to rebuild this model" if given is None else "base_model does not rebuild the model"
    with pytest.raises(CorpError, match=expected) as raised:
        compress_to_artifact(small_vit(), CompressConfig(), spec, tmp_path / "art", base_model=given)
    assert "tensors of other shapes (e.g. cls_token: [1, 1, 48] in the model given" in str(raised.value)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("standard", [False, True])
def test_a_true_base_model_record_passes_for_a_model_as_timm_builds_it_or_in_standard_form(standard):
    """A Swin's blocks are rewritten by standard_form (other tensor names): the record is checked
    against the model in the form it was given."""
    import timm

    from corp_deploy.base_model import check_base_model
    from corp_deploy.families import standard_form

    kwargs = {"img_size": 56, "patch_size": 4, "window_size": 7, "embed_dim": 32, "depths": (1, 1), "num_heads": (1, 2)}
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **kwargs)
    model = standard_form(model) if standard else model
    check_base_model({"name": "swin_tiny_patch4_window7_224", "model_kwargs": kwargs}, model, inferred=False)
    wrong = {"name": "swin_tiny_patch4_window7_224", "model_kwargs": {"img_size": 56}}
    with pytest.raises(CorpError, match="base_model does not rebuild"):
        check_base_model(wrong, model, inferred=False)


@pytest.mark.parametrize("name, hint", [("foo", ""), ("s", " (the command line's --s is sparsity)"), ("options", "")])
def test_from_settings_refuses_an_unknown_name_listing_the_settings(name, hint):
    with pytest.raises(CorpError, match=re.escape(f"unknown setting {name}{hint}; the settings are calibration, ")):
        CompressConfig.from_settings(macs=0.6, **{name: 0.5})


def test_no_output_folder_in_one_process_is_refused_before_the_work(small_vit, spec, monkeypatch):
    monkeypatch.setattr("corp_deploy.workflow.compress", lambda *args, **kwargs: pytest.fail("the work started"))
    with pytest.raises(CorpError, match="out_dir is None: give the artifact's folder"):
        compress_to_artifact(small_vit(), CompressConfig(), spec, None, base_model=BASE_MODEL)


def test_a_weights_record_given_is_completed_and_checked_against_the_model(spec, tmp_path):
    """A record of where the dense weights came from, given through the Python API, is what export
    --dense, bench and recover rebuild the dense model from: a checkpoint's SHA-256 is added, and a
    record that rebuilds other weights than the model's is refused before any work."""
    from safetensors.torch import save_file

    from corp_deploy import create_base_model, load_base_model
    from corp_deploy.errors import BadUsage
    from corp_deploy.files import sha256_file

    dense = create_base_model("deit_tiny", SMALL_VIT_KWARGS, pretrained=False, seed=3)
    checkpoint = tmp_path / "dense.safetensors"
    save_file(dense.state_dict(), str(checkpoint))
    base = {**BASE_MODEL, "weights": {"source": "checkpoint", "path": str(checkpoint)}}
    result = compress_to_artifact(dense, CompressConfig(s_mlp=0.5), spec, tmp_path / "art", base_model=base)
    recorded = json.loads((result.path / "config.json").read_text())["base_model"]["weights"]
    assert recorded == {"source": "checkpoint", "path": str(checkpoint.resolve()), "sha256": sha256_file(checkpoint)}
    rebuilt = load_base_model(result.path).state_dict()
    assert all(torch.equal(rebuilt[k], v) for k, v in dense.state_dict().items())

    other_seed = {**BASE_MODEL, "weights": {"source": "random", "seed": 4}}
    with pytest.raises(CorpError, match=r"weights record \(random\) does not rebuild the model given \(.* differs\)"):
        compress_to_artifact(dense, CompressConfig(s_mlp=0.5), spec, tmp_path / "other", base_model=other_seed)
    for bad in ({"source": "disk"}, {"source": "random", "seed": -1}, {"source": "random", "seed": 3, "by": "me"}):
        with pytest.raises(
            BadUsage, match=r"base_model's 'weights' is \{'source': 'checkpoint', 'path': FILE\}.*; got"
        ):
            compress_to_artifact(
                dense, CompressConfig(), spec, tmp_path / "bad", base_model={**BASE_MODEL, "weights": bad}
            )
    assert not (tmp_path / "other").exists() and not (tmp_path / "bad").exists()
    same_seed = {**BASE_MODEL, "weights": {"source": "random", "seed": 3}}
    result = compress_to_artifact(dense, CompressConfig(s_mlp=0.5), spec, tmp_path / "seeded", base_model=same_seed)
    assert json.loads((result.path / "config.json").read_text())["base_model"]["weights"] == same_seed["weights"]
