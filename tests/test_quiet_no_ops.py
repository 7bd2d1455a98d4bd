"""Settings that would do nothing, or claim what was not done, say so (issue 68).

A parity limit that cannot be measured (top-1 agreement of a model without a classifier) is refused
before the export, as ``bench``'s gate fails on a limit with nothing measured; a MAC budget that the
dense model fits warns, as ``--s 0`` does, that the artifact is the dense model; a joint sparsity
that every pruned part's own sparsity overrides is refused.
"""

import dataclasses
import json

import pytest

from corp_deploy import CompressConfig
from corp_deploy.cost import share_text
from corp_deploy.errors import EXIT_GATE_FAILED, SettingError
from exporters import ExportOptions, Tolerance, export_artifact
from exporters.manifest import read_manifest
from exporters.pipeline import ParityError
from tests.helpers import SMALL_VIT_CLI_ARGS

COMPRESS = ["compress", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--calib-samples", 4, "--seed", 0]
DENSE_WARNING = "every dim is kept, and the artifact is the dense model"
NO_TOP1 = "top-1 agreement cannot be measured on a model without a classifier"


@pytest.fixture(scope="module")
def backbone(run_cli, tmp_path_factory):
    """A feature model's artifact (the small ViT with ``num_classes=0``, random weights of seed 0)."""
    root = tmp_path_factory.mktemp("backbone")
    result, text = run_cli([*COMPRESS, "--model-arg", "num_classes=0", "--s", 0.5, "-o", root / "art"], root / "state")
    assert result.exit_code == 0, text
    return root / "art"


@pytest.fixture
def never_exported(monkeypatch):
    """Fails the test if any ONNX graph is traced: a refusal must come before the export."""
    import exporters.pipeline

    def export_onnx(*args, **kwargs):
        raise AssertionError("an ONNX graph was exported")

    monkeypatch.setattr(exporters.pipeline, "export_onnx", export_onnx)


# ---------------------------------------------------------------- a parity limit nothing measures


def test_a_top1_limit_on_a_model_without_a_classifier_is_refused_before_the_export(
    backbone, tmp_path, run_cli, never_exported
):
    """``export --min-top1`` on a feature model: exit 4 (a gate on what was not measured fails, as in
    bench), naming the feature limit to use instead; nothing is exported or written. Before: exit 0
    and ``min_top1: 0.99`` beside ``top1_agreement: null`` in export.json."""
    out = tmp_path / "out"
    result, text = run_cli(
        ["export", backbone, "--precision", "fp16", "--min-top1", 0.99, "-o", out], tmp_path / "state"
    )
    flat = " ".join(text.split())
    assert result.exit_code == EXIT_GATE_FAILED, text
    assert f"--min-top1 0.99: {NO_TOP1}" in flat and "--min-cosine" in flat, text
    assert not out.exists()


def test_the_library_refuses_a_top1_limit_on_a_model_without_a_classifier(backbone, tmp_path, never_exported):
    options = ExportOptions(precision="fp16", tolerance=Tolerance(min_cosine=0.99, min_top1=0.9))
    with pytest.raises(ParityError, match=NO_TOP1) as refused:
        export_artifact(backbone, tmp_path / "out", options)
    assert refused.value.exit_code == EXIT_GATE_FAILED and not (tmp_path / "out").exists()


@pytest.mark.parametrize("limits", [[], ["--min-cosine", 0.99]], ids=["defaults", "a-cosine-limit"])
def test_a_feature_model_export_records_no_top1_limit(backbone, tmp_path, run_cli, limits):
    """fp16's default top-1 limit (0.85) applies to classifiers: a feature model's export checks its
    cosine and records ``min_top1: null``, not a limit it never applied."""
    out = tmp_path / "out"
    result, text = run_cli(["export", backbone, "--precision", "fp16", *limits, "-o", out], tmp_path / "state")
    assert result.exit_code == 0, text
    manifest = read_manifest(out)
    assert manifest.tolerance == {"atol": None, "min_cosine": limits[1] if limits else 0.999, "min_top1": None}
    parity = manifest.models["model"].parity["onnxruntime_vs_pytorch"]
    assert all(numbers["top1_agreement"] is None for numbers in parity.values())


def test_a_classifier_keeps_its_top1_limit_and_the_other_defaults(tiny_artifact, tmp_path, run_cli):
    """``--min-top1`` on a classifier is measured and recorded; the precision's other limits stay."""
    out = tmp_path / "out"
    result, text = run_cli(["export", tiny_artifact, "--min-top1", 0.5, "-o", out], tmp_path / "state")
    assert result.exit_code == 0, text
    manifest = read_manifest(out)
    assert manifest.tolerance == {"atol": 1e-4, "min_cosine": 0.99999, "min_top1": 0.5}
    parity = manifest.models["model"].parity["onnxruntime_vs_pytorch"]
    assert all(numbers["top1_agreement"] == 1 for numbers in parity.values())


# ---------------------------------------------------------------- a budget that prunes nothing


@pytest.mark.parametrize("budget", [["--macs", 1], ["--speedup", 1]], ids=["macs-1", "speedup-1"])
def test_a_budget_the_dense_model_fits_warns_that_the_artifact_is_dense(tmp_path, run_cli, budget):
    result, text = run_cli([*COMPRESS, *budget, "-o", tmp_path / "art"], tmp_path / "state")
    assert result.exit_code == 0, text
    flat = " ".join(text.split())
    assert "the MAC budget (1 of the dense MACs) fits the dense model" in flat and DENSE_WARNING in flat, text
    report = json.loads((tmp_path / "art" / "report.json").read_text())
    assert report["macs"]["compressed"] == report["macs"]["dense"]


def test_a_budget_just_below_the_dense_model_is_never_written_as_1(tmp_path, run_cli):
    """``--speedup 1.0001`` is a budget of 0.9999 of the dense MACs: the budget's table (and the
    warning, where nothing could be pruned for it) say 0.9999, not 1."""
    result, text = run_cli([*COMPRESS, "--speedup", 1.0001, "-o", tmp_path / "art"], tmp_path / "state")
    assert result.exit_code == 0, text
    flat = " ".join(text.split())
    assert "budget 0.9999 of the dense MACs" in flat and "1 of the dense MACs" not in flat, text


def test_a_share_of_the_dense_macs_shows_the_digits_that_tell_it_from_0_and_1():
    assert [share_text(f) for f in (0.5, 1 / 3, 1.0, 0.0)] == ["0.5", "0.333", "1", "0"]
    assert [share_text(f) for f in (1 / 1.0001, 1 - 1e-12, 1e-9)] == ["0.9999", "0.999999999999", "1e-09"]


def test_any_budget_whose_plan_keeps_every_unit_warns(tmp_path, run_cli, monkeypatch):
    """The warning follows what was pruned, not the value given: an allocation that keeps every unit
    whole under ``--macs 0.9`` warns as ``--macs 1`` does."""
    import corp_deploy.methods.corp.budget as budget_module

    monkeypatch.setattr(budget_module, "allocate", lambda units, *args, **kwargs: [unit.total for unit in units])
    result, text = run_cli([*COMPRESS, "--macs", 0.9, "-o", tmp_path / "art"], tmp_path / "state")
    assert result.exit_code == 0, text
    assert "the MAC budget (0.9 of the dense MACs) fits the dense model" in " ".join(text.split()), text


def test_a_budget_that_prunes_does_not_warn(tmp_path, run_cli):
    result, text = run_cli([*COMPRESS, "--macs", 0.7, "-o", tmp_path / "art"], tmp_path / "state")
    assert result.exit_code == 0, text
    assert DENSE_WARNING not in " ".join(text.split()), text


@pytest.mark.slow
def test_a_sweep_warns_of_each_point_that_pruned_nothing(tmp_path, run_cli):
    out = tmp_path / "sweep"
    result, text = run_cli(
        ["sweep", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--macs", "1,0.7", "--methods", "corp"]
        + ["--calib-samples", 4, "--data-samples", 2, "--backends", "torch", "--batch", 1, "--min-time", 0.01]
        + ["-o", out],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    flat = " ".join(text.split())
    said = "corp-macs1: the MAC budget (1 of the dense MACs) fits the dense model, so no unit was pruned"
    assert f"{said}: {DENSE_WARNING}" in flat and "corp-macs0.7: the MAC budget" not in flat, text


# ---------------------------------------------------------------- a joint sparsity that applies to no part


@pytest.mark.parametrize(
    "given",
    [
        {"sparsity": 0.3, "s_mlp": 0.5, "s_attn": 0.4},
        {"sparsity": 0.3, "s_mlp": 0.5, "target": "mlp"},
        {"sparsity": 0.3, "s_mlp": 0.5, "s_attn": 0.4, "s_vo": 0.2, "target": "all"},
    ],
    ids=["both", "mlp", "all"],
)
def test_a_joint_sparsity_every_pruned_part_overrides_is_refused(given):
    """``--s 0.3 --s-mlp 0.5 --s-attn 0.4`` (target ``both``) applied 0.5 and 0.4 and nothing of
    0.3, without a word: the joint sparsity applied to no part."""
    with pytest.raises(SettingError, match=r"sparsity 0\.3 applies to no part: every part that target"):
        CompressConfig(**given)


def test_a_joint_sparsity_that_fills_in_a_part_and_its_rebuilt_copies_pass():
    """The joint sparsity fills in the part without its own; ``dataclasses.replace`` passes every
    part's filled-in value with it again, and that is no override (each still equals it)."""
    config = CompressConfig(sparsity=0.3, s_mlp=0.5)
    assert (config.s_mlp, config.s_attn, config.s_vo) == (0.5, 0.3, 0.0)
    rebuilt = dataclasses.replace(config, round_to=2)
    assert (rebuilt.s_mlp, rebuilt.s_attn, rebuilt.round_to) == (0.5, 0.3, 2)
    assert CompressConfig(sparsity=0.3, s_mlp=0.3, s_attn=0.4).s_attn == 0.4  # --s applied to the MLP


def test_the_command_line_names_the_overridden_joint_sparsity(tmp_path, run_cli):
    args = ["--s", 0.3, "--s-mlp", 0.5, "--s-attn", 0.4, "-o", tmp_path / "art"]
    result, text = run_cli([*COMPRESS, *args], tmp_path / "state")
    flat = " ".join(text.split())
    assert result.exit_code == 2, text
    assert "--s 0.3 applies to no part: every part that --target both prunes has a sparsity of its own" in flat
    assert "(--s-mlp, --s-attn). Leave --s out, or one of those" in flat, text
    assert not (tmp_path / "art").exists()
