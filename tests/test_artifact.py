"""Artifact save/load: bit-exact round trip, self-description, atomic writes."""

import json
import re

import pytest
import torch

from corp_deploy import (
    CompressConfig,
    compress,
    create_base_model,
    load_base_model,
    load_compressed,
    read_config,
    save_artifact,
)
from corp_deploy.base_model import WEIGHTS_FORMS, base_model_spec
from corp_deploy.errors import CorpError
from corp_deploy.families import examples
from corp_deploy.latest import latest_artifact, record_latest
from corp_deploy.models import base_skeleton
from tests.helpers import SMALL_VIT_KWARGS


@pytest.fixture
def compressed(vit, batches):
    model, report = compress(vit, batches, CompressConfig(s_mlp=0.5, s_attn=0.5))
    return vit, model, report


def save(model, report, path, name="deit_tiny_patch16_224", kwargs=SMALL_VIT_KWARGS):
    return save_artifact(
        model,
        path,
        base_model={"name": name, "model_kwargs": dict(kwargs), "weights": {"source": "random", "seed": 0}},
        settings=CompressConfig().to_dict(),
        calibration={"images": 24},
        report=report,
    )


def test_round_trip_is_bit_exact(compressed, tmp_path, image_batches):
    dense, model, report = compressed
    path = save(model, report, tmp_path / "art")
    loaded = load_compressed(path)
    x = image_batches(1, 5, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


def test_config_describes_the_model(compressed, tmp_path):
    dense, model, report = compressed
    path = save(model, report, tmp_path / "art")
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "corp-deploy-record.json",
        "model.safetensors",
        "report.json",
    ]
    cfg = read_config(path)
    written = json.loads((path / "config.json").read_text())
    assert cfg.to_dict() == written  # the typed document is the file, entry for entry
    assert written["format_version"] == 2 and cfg.settings["method"] == "corp"
    assert "method" not in written  # recorded once, in the settings
    assert cfg.base_model.name == "deit_tiny_patch16_224"
    assert cfg.blocks[0].to_dict() == {
        "mlp_hidden": 96,
        "num_heads": 3,
        "qk_head_dim": 8,
        "v_head_dim": 16,
        "attention": "pruned",
        "scale": 0.25,
    }
    assert cfg.input.input_size == (3, 32, 32)
    assert {"torch", "timm", "corp_deploy", "safetensors"} <= set(cfg.versions)
    saved_report = json.loads((path / "report.json").read_text())
    assert saved_report["params"] == report["params"]
    assert len(saved_report["layers"]) == 2 and "ridge_lambda" in saved_report["layers"][0]["mlp"]


def test_spec_is_inferred_from_a_user_built_model_and_checked(compressed, tmp_path):
    dense, model, report = compressed
    spec = base_model_spec(dense)
    assert spec == {"name": "deit_tiny_patch16_224", "model_kwargs": {"img_size": [32, 32], "num_classes": 1000}}
    with pytest.raises(CorpError, match="does not rebuild"):  # depth/width are not inferable
        save(model, report, tmp_path / "art", kwargs=spec["model_kwargs"])
    assert not (tmp_path / "art").exists()


def test_failed_write_leaves_nothing(compressed, tmp_path, monkeypatch):
    dense, model, report = compressed
    import safetensors.torch

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        save(model, report, tmp_path / "art")
    assert list(tmp_path.iterdir()) == []


def test_existing_artifact_is_replaced_but_other_directories_are_refused(compressed, tmp_path):
    dense, model, report = compressed
    path = save(model, report, tmp_path / "art")
    save(model, report, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(CorpError, match="refusing"):
        save(model, report, other)
    assert (other / "notes.txt").read_text() == "keep me"


def test_corrupt_or_foreign_artifacts_are_refused(compressed, tmp_path):
    dense, model, report = compressed
    path = save(model, report, tmp_path / "art")
    with pytest.raises(CorpError, match="not a corp-deploy artifact"):
        load_compressed(tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CorpError, match="config.json does not match the SHA-256"):
        load_compressed(path)
    path = save(model, report, tmp_path / "art2")
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CorpError, match="model.safetensors does not match the SHA-256"):
        load_compressed(path)


def test_latest_artifact_pointer(compressed, tmp_path, monkeypatch):
    monkeypatch.setenv("CORP_DEPLOY_STATE_DIR", str(tmp_path / "state"))
    with pytest.raises(CorpError, match="none recorded"):
        latest_artifact()
    dense, model, report = compressed
    path = save(model, report, tmp_path / "art")
    record_latest(path)
    assert latest_artifact() == path.resolve()


def test_base_model_is_inferred_when_not_given(tmp_path, image_batches):
    import timm

    torch.manual_seed(0)
    dense = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=7).eval()
    model, report = compress(dense, image_batches(1, 4), CompressConfig(s_mlp=0.5, s_attn=0.5))
    path = save_artifact(model, tmp_path / "art", report=report)
    assert read_config(path).base_model.model_kwargs == {"img_size": [32, 32], "num_classes": 7}
    x = image_batches(1, 2, seed=5)[0]
    with torch.no_grad():
        assert torch.equal(load_compressed(path)(x), model(x))


def test_load_base_model_rebuilds_the_recorded_dense_weights(tmp_path, image_batches):
    from safetensors.torch import save_file

    from corp_deploy.files import sha256_file

    dense = create_base_model("deit_tiny", SMALL_VIT_KWARGS, pretrained=False, seed=3)
    model, report = compress(dense, image_batches(1, 4), CompressConfig(s_mlp=0.5, s_attn=0.5))
    checkpoint = tmp_path / "dense.safetensors"

    def offset(key: str) -> float:  # the patch embedding is the artifact's (compression never changes it)
        return 0.0 if key.startswith("patch_embed.") else 0.5

    save_file({k: v + offset(k) for k, v in dense.state_dict().items()}, str(checkpoint))
    sources = {
        "random": {"source": "random", "seed": 3},
        "checkpoint": {"source": "checkpoint", "path": str(checkpoint), "sha256": sha256_file(checkpoint)},
        "unknown": None,
    }
    paths = {
        name: save_artifact(
            model,
            tmp_path / name,
            report=report,
            base_model={"name": "deit_tiny_patch16_224", "model_kwargs": SMALL_VIT_KWARGS, "weights": weights},
        )
        for name, weights in sources.items()
    }
    for name, shift in (("random", lambda key: 0.0), ("checkpoint", offset)):
        rebuilt = load_base_model(paths[name]).state_dict()
        assert all(torch.equal(rebuilt[k], v + shift(k)) for k, v in dense.state_dict().items()), name
    lying = {
        "name": "deit_tiny_patch16_224",
        "model_kwargs": SMALL_VIT_KWARGS,
        "weights": {"source": "random", "seed": 4},
    }
    save_artifact(model, tmp_path / "lying", report=report, base_model=lying)
    with pytest.raises(CorpError, match="is not the one it was compressed from .patch_embed.proj"):
        load_base_model(tmp_path / "lying")
    expected = "does not record where its dense weights came from, .* the weights " + re.escape(WEIGHTS_FORMS)
    with pytest.raises(CorpError, match=expected):
        load_base_model(paths["unknown"])
    save_file(dense.state_dict(), str(checkpoint))
    with pytest.raises(CorpError, match="has changed since"):
        load_base_model(paths["checkpoint"])
    checkpoint.unlink()
    with pytest.raises(CorpError, match="no longer exists"):
        load_base_model(paths["checkpoint"])


@pytest.mark.parametrize(
    "change, mismatches",
    [
        (lambda model: setattr(model.norm, "bias", None), "missing 1 tensors (e.g. norm.bias)"),
        (lambda model: model.register_buffer("extra", torch.zeros(1)), "1 unexpected tensors (e.g. extra)"),
        (
            lambda model: setattr(model, "head", torch.nn.Linear(48, 5)),
            "2 tensors of other shapes (e.g. head.weight: [5, 48] in the compressed model, [1000, 48] in the "
            "model the record rebuilds)",
        ),
    ],
    ids=["missing-tensor", "extra-tensor", "other-shape"],
)
def test_a_model_its_base_model_does_not_rebuild_is_refused(compressed, tmp_path, change, mismatches):
    """The check on the weightless skeleton refuses a state dict with a tensor missing, one too many,
    or one of another shape, summarised in one line as for checkpoints, and writes nothing."""
    dense, model, report = compressed
    change(model)
    with pytest.raises(CorpError, match=re.escape(f"does not rebuild this model ({mismatches})")):
        save(model, report, tmp_path / "art")
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("family", sorted(examples()))
def test_every_family_is_checked_without_weights_and_loads_the_weights_it_saved(family, tmp_path, monkeypatch):
    """Saving checks the artifact against a skeleton on the meta device (no dense model is built; every
    buffer, Swin's shift-mask groups included, has the shape of the real model's), and loading gives
    back exactly the saved weights. Compressed models of every family are saved in test_families."""
    from corp_deploy import artifact

    example = examples()[family]
    model = create_base_model(example.model, example.kwargs, pretrained=False, seed=0)
    skeletons = []

    def recorded_skeleton(*args, **kwargs):
        skeletons.append(base_skeleton(*args, **kwargs))
        return skeletons[-1]

    def no_dense_model(*args, **kwargs):
        raise AssertionError("saving built a dense model")

    monkeypatch.setattr(artifact, "base_skeleton", recorded_skeleton)
    monkeypatch.setattr(artifact, "create_base_model", no_dense_model)
    path = save_artifact(
        model,
        tmp_path / "art",
        base_model={"name": example.model, "model_kwargs": example.kwargs, "weights": {"source": "random", "seed": 0}},
    )
    monkeypatch.undo()
    [skeleton] = skeletons
    assert {t.device.type for t in [*skeleton.parameters(), *skeleton.buffers()]} == {"meta"}
    assert {k: v.shape for k, v in skeleton.named_buffers()} == {k: v.shape for k, v in model.named_buffers()}
    loaded = load_compressed(path).state_dict()
    assert list(loaded) == list(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "settings, report, message",
    [
        (
            CompressConfig(s_mlp=0.9, s_attn=0.5).to_dict(),
            None,
            "they keep 19 mlp dims in block 0, the model saved has 96",
        ),
        (CompressConfig(s_mlp=0.5, target="mlp").to_dict(), None, "qk dims in block 0"),
        ({"bogus": object()}, None, "settings cannot be written as JSON (Object of type object"),
        (None, {"params": {"compressed": 1}}, "report is of another model: 1 parameters in it, "),
    ],
)
def test_records_that_contradict_the_model_saved_are_refused_before_writing(
    compressed, tmp_path, settings, report, message
):
    """save_artifact refuses settings of uniform CORP whose kept dims are not the model's, a report
    of another parameter count, and records JSON cannot hold; nothing is written."""
    _, model, real_report = compressed
    base = {"name": "deit_tiny_patch16_224", "model_kwargs": dict(SMALL_VIT_KWARGS)}
    with pytest.raises(CorpError, match=re.escape(message)):
        save_artifact(model, tmp_path / "art", base_model=base, settings=settings, report=report or real_report)
    assert list(tmp_path.iterdir()) == []
