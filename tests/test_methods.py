"""Every compression method through the same artifact, load and export path, on a tiny random
ViT: shapes, MAC counts against an independent formula, load round trip, ONNX Runtime
parity; and the method/option combinations the CLI refuses."""

import json
import re

import pytest
import torch

from corp_deploy import (
    METHODS,
    CompressConfig,
    CorpError,
    compress,
    count_macs,
    load_compressed,
    read_config,
    save_artifact,
)
from corp_deploy.errors import SettingError
from exporters import ExportOptions, export_artifact
from tests.helpers import SMALL_VIT_CLI_ARGS, SMALL_VIT_KWARGS

TOKENS, WIDTH, HEADS, HEAD_DIM, HIDDEN = 17, 48, 3, 16, 192


def expected_macs(blocks: list[tuple[int, int, int]]) -> int:
    """MACs of the tiny ViT from each block's (MLP hidden, q/k dim, v dim), written out
    independently of ``count_macs``."""
    patch = 16 * (3 * 8 * 8) * WIDTH
    head = WIDTH * 1000  # the classifier reads the class token only
    total = 0
    for hidden, qk_dim, v_dim in blocks:
        qkv = TOKENS * WIDTH * HEADS * (2 * qk_dim + v_dim)
        logits_and_values = HEADS * TOKENS * TOKENS * (qk_dim + v_dim)
        proj = TOKENS * HEADS * v_dim * WIDTH
        total += qkv + logits_and_values + proj + 2 * TOKENS * WIDTH * hidden
    return patch + total + head


CASES = {  # method config -> each block's (MLP hidden, q/k dim, v dim), or None: allocated (checked below)
    "corp": (dict(s_mlp=0.5, s_attn=0.25), [(96, 12, 16)] * 2),
    "corp-all": (dict(target="all", s_mlp=0.5, s_attn=0.25, s_vo=0.5), [(96, 12, 8)] * 2),
    "corp-budget": (dict(macs=0.6, round_to=2), None),
    "vbp": (dict(method="vbp", s_mlp=0.5), None),
    "toast": (dict(method="toast", s_mlp=0.5, s_attn=0.25), [(96, 12, 12)] * 2),
    "toast-attn": (dict(method="toast", target="attn", s_attn=0.5), [(192, 8, 8)] * 2),
}


@pytest.mark.parametrize("case", CASES)
def test_method_shapes_macs_round_trip_and_onnx_parity(vit, batches, tmp_path, case, image_batches):
    kwargs, expected = CASES[case]
    config = CompressConfig.from_settings(**kwargs)
    model, report = compress(vit, batches, config)
    dims = [(d["mlp_hidden"], d["qk_head_dim"], d["v_head_dim"]) for d in (layer["dims"] for layer in report["layers"])]
    if case == "vbp":  # a global allocation; the total is fixed, the split is data-dependent
        assert sum(h for h, _, _ in dims) == 192 and all(h >= 20 and (qk, v) == (16, 16) for h, qk, v in dims)
    elif expected is None:  # a budget: every size a multiple of round_to, MACs within it
        assert all(size % 2 == 0 for block in dims for size in block)
        assert report["macs"]["compressed"] <= 0.6 * report["macs"]["dense"]
    else:
        assert dims == expected
    assert report["macs"]["compressed"] == count_macs(model, (3, 32, 32)) == expected_macs(dims)
    assert report["macs"]["dense"] == expected_macs([(HIDDEN, HEAD_DIM, HEAD_DIM)] * 2)

    artifact = save_artifact(
        model,
        tmp_path / "art",
        report=report,
        settings=config.to_dict(),
        base_model={"name": "deit_tiny_patch16_224", "model_kwargs": SMALL_VIT_KWARGS},
    )
    recorded = read_config(artifact)
    assert recorded.settings["method"] == config.method and "method" not in recorded.to_dict()  # recorded once
    x = image_batches(1, 3, seed=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(load_compressed(artifact)(x), model(x), rtol=0, atol=0)
    result = export_artifact(artifact, tmp_path / "export", ExportOptions())
    assert result.manifest.artifact.method == config.method
    for numbers in result.manifest.models["model"].parity["onnxruntime_vs_pytorch"].values():
        assert numbers["max_abs"] < 1e-4 and numbers["top1_agreement"] == 1.0, numbers


@pytest.mark.parametrize("method", ["vbp", "toast"])
def test_zero_sparsity_reproduces_the_dense_model(vit, batches, method, image_batches):
    x = image_batches(1, 4, seed=7)[0]
    model, _ = compress(vit, batches, CompressConfig(method=method, s_mlp=0.0, s_attn=0.0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), vit(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "vbp", "--s-attn", "0.3"], "--s-attn has no meaning"),
        (["--method", "vbp", "--target", "both"], "prunes MLP hidden channels only"),
        (["--method", "vbp", "--ranker", "energy"], "--ranker applies to --method corp only"),
        (["--method", "vbp", "--calibration", "sequential"], "--calibration applies to --method corp only"),
        (["--method", "toast", "--no-compensation"], "toast has no compensation step"),
        (["--method", "toast", "--ridge", "0.1"], "--ridge applies to --method corp only"),
        (["--method", "corp", "--layer-floor", "0.2"], "--layer-floor applies to --method vbp only"),
        (["--method", "vbp", "--token-fraction", "0.05"], "--token-fraction applies to --method toast only"),
        (["--method", "toast", "--token-fraction", "0"], "--token-fraction must be in (0, 1]"),
    ],
)
def test_bad_method_combinations_are_refused_before_any_work(tmp_path, args, message, run_cli):
    out = tmp_path / "out"
    result, text = run_cli(
        ["compress", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, *args, "-o", out], tmp_path / "state"
    )
    assert result.exit_code == 2 and message in text and "Traceback" not in text, text
    assert not out.exists()


def test_unknown_method_is_a_usage_error(tmp_path, run_cli):
    result, text = run_cli(["compress", "deit_tiny", "--method", "magic"], tmp_path / "state")
    assert result.exit_code == 2 and "'magic' is not one of 'corp', 'vbp', 'toast'" in text


def test_cli_vbp_defaults_to_the_mlp_and_names_its_output(tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    result, text = run_cli(
        [
            "compress",
            "deit_tiny",
            "--no-pretrained",
            *SMALL_VIT_CLI_ARGS,
            "--method",
            "vbp",
            "--s",
            "0.3",
            "--calib-samples",
            6,
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    artifact = tmp_path / "corp-deploy" / "deit_tiny-vbp-mlp-s0.3"
    settings = read_config(artifact).settings
    assert (settings["method"], settings["target"], settings["s_mlp"]) == ("vbp", "mlp", 0.3)
    result, text = run_cli(["export", artifact], tmp_path / "state")
    assert result.exit_code == 0, text
    assert json.loads((artifact / "export-fp32" / "export.json").read_text())["artifact"]["method"] == "vbp"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="vbp", ranker="energy"), "ranker applies to method corp only, not vbp"),
        (dict(method="vbp", calibration="sequential"), "calibration applies to method corp only"),
        (dict(method="toast", layer_floor=0.3), "layer_floor applies to method vbp only"),
        (dict(method="corp", token_fraction=0.2), "token_fraction applies to method toast only"),
        (dict(method="toast", compensation=False), "toast has no compensation step"),
        (dict(method="vbp", target="attn"), "vbp prunes MLP hidden channels only"),
    ],
)
def test_the_library_refuses_settings_the_method_would_not_read(kwargs, message):
    with pytest.raises(CorpError, match=re.escape(message)):
        CompressConfig.from_settings(**kwargs)


def test_config_cli_and_sweep_read_the_method_registry():
    from benchmarks.sweep import SWEEP_METHODS
    from corp_deploy.cli.compress import compress as compress_command

    for name, method in METHODS.items():
        assert method.name == name and method.default_target in method.targets
        config = CompressConfig(method=name)
        assert config.target == method.default_target and type(config.options) is method.options_class
    choices = next(p for p in compress_command.params if p.name == "method").type.choices
    assert list(choices) == list(METHODS) and SWEEP_METHODS == (*METHODS, "uncompensated")


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(macs=0.6, equal_head_dims=True),
        dict(speedup=2.0, ranker="energy"),
        dict(s_mlp=0.3, calibration="sequential", ridge=0.1, round_to=4),
        dict(method="vbp", s_mlp=0.2, layer_floor=0.3),
        dict(method="toast", s_attn=0.25, token_fraction=0.5),
    ],
)
def test_flat_settings_round_trip_through_the_method_options(settings):
    """``to_dict`` writes every method's options (the others at their defaults) and
    ``from_settings`` reads them back into the same config, with the method's own options class."""
    config = CompressConfig.from_settings(**settings)
    assert type(config.options) is METHODS[config.method].options_class
    flat = config.to_dict()
    assert {name: flat[name] for name in settings} == settings
    assert CompressConfig.from_settings(**flat) == config


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(target="mlp", s_attn=0.3), "s_attn has no effect with target mlp, which prunes mlp only"),
        (dict(s_vo=0.3), "s_vo has no effect with target both, which prunes mlp and qk only"),
        (dict(method="vbp", s_attn=0.3), "method vbp prunes MLP hidden channels only; s_attn has no meaning for it"),
    ],
)
def test_a_sparsity_of_a_part_left_whole_is_refused(settings, message):
    """Above 0 it would be recorded and never applied; 0 is what a part left whole records."""
    with pytest.raises(SettingError, match=message):
        CompressConfig.from_settings(**settings)
    config = CompressConfig(target="mlp", s_mlp=0.3, s_attn=0.0)
    assert (config.s_attn, config.s_vo) == (0.0, 0.0) and CompressConfig.from_dict(config.to_dict()) == config


def test_options_of_another_method_are_refused():
    from corp_deploy import CorpOptions, VbpOptions

    with pytest.raises(CorpError, match="method vbp takes VbpOptions, not CorpOptions"):
        CompressConfig(method="vbp", options=CorpOptions())
    assert CompressConfig(method="vbp", options=VbpOptions(layer_floor=0.5)).options.layer_floor == 0.5


def test_compress_options_are_the_method_options_fields():
    """Every ``option(...)`` field of every method is a ``compress`` option with the field's
    default; plain fields are library-only."""
    from corp_deploy.cli.compress import compress as compress_command

    params = {p.name: p for p in compress_command.params}
    for method in METHODS.values():
        for field in method.options_class.fields():
            if "help" in field.metadata:
                assert params[field.name].default == field.default
                assert params[field.name].help.startswith(f"{method.name}: ")
            else:
                assert field.name not in params
