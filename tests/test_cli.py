"""The corp-deploy command line: end to end on a tiny model, and every bad input."""

import numpy as np
import pytest
import timm
import torch
from click.testing import CliRunner
from PIL import Image

from corp_deploy import load_compressed, read_config
from corp_deploy.cli import cli
from corp_deploy.latest import latest_artifact
from tests.helpers import SMALL_VIT_CLI_ARGS as TINY


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CORP_DEPLOY_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def calib_dir(tmp_path):
    root = tmp_path / "calib"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(6):
        ext = ["png", "jpg", "webp"][i % 3]
        folder = root / "sub" if i % 2 else root
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(folder / f"im{i}.{ext}")
    (root / "broken.jpg").write_bytes(b"not an image")
    (root / "notes.txt").write_text("ignored")
    return root


def run(args):
    result = CliRunner().invoke(cli, args)
    return result, result.output + (result.stderr if hasattr(result, "stderr") else "")


def test_compress_end_to_end_on_a_directory(tmp_path, calib_dir):
    out = tmp_path / "out"
    result, text = run(
        [
            "compress",
            "deit_tiny",
            "--no-pretrained",
            *TINY,
            "--s-mlp",
            "0.5",
            "--s-attn",
            "0.25",
            "--calib",
            str(calib_dir),
            "--calib-samples",
            "10",
            "--batch-size",
            "4",
            "-o",
            str(out),
        ]
    )
    assert result.exit_code == 0, text
    assert "skipped 1 unreadable" in text and "parameters (M)" in text and "fewer than" not in text
    cfg = read_config(out)
    assert cfg.calibration["images_used"] == 10 and cfg.calibration["files_skipped"] == 1  # 6 files, 4 crops
    assert "crops" in cfg.calibration and cfg.settings["calib_crops"] is True
    assert cfg.settings["s_mlp"] == 0.5 and cfg.settings["s_attn"] == 0.25
    assert [b.qk_head_dim for b in cfg.blocks] == [12, 12]
    assert cfg.base_model.weights["source"] == "random"
    model = load_compressed(out)
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 1000)
    assert latest_artifact() == out.resolve()


def test_default_output_dir_builtin_calibration_and_pth_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    dense = timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)
    torch.save({"model": dense.state_dict()}, tmp_path / "w.pth")
    result, text = run(
        [
            "compress",
            "deit_tiny",
            *TINY,
            "--checkpoint",
            str(tmp_path / "w.pth"),
            "--s",
            "0.5",
            "--calib-samples",
            "6",
            "--target",
            "mlp",
        ]
    )
    assert result.exit_code == 0, text
    assert "built-in photos" in text
    out = tmp_path / "corp-deploy" / "deit_tiny-mlp-s0.5"
    cfg = read_config(out)
    assert cfg.calibration["source"] == "builtin" and cfg.calibration["images_used"] == 6
    assert cfg.base_model.weights["source"] == "checkpoint"
    assert torch.equal(load_compressed(out).blocks[0].attn.qkv.weight, dense.blocks[0].attn.qkv.weight)


def test_help_has_examples():
    result, text = run(["compress", "--help"])
    assert result.exit_code == 0 and "Examples:" in text and "--calibration" in text


def bad_inputs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "a.png").write_bytes(b"\x89PNG garbage")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"garbage")
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"foo": torch.zeros(2)}, str(other))
    base = ["compress", "deit_tiny", "--no-pretrained", *TINY, "--calib-samples", "4"]
    return [
        (["compress", "resnet_nonexistent"], "unknown model"),
        (["compress", "resnet18", "--no-pretrained"], "timm ResNet, which has no sequence of transformer blocks"),
        # refusals name the class that is not supported, not the model's name pattern
        (
            [
                "compress",
                "beit_base_patch16_224",
                "--no-pretrained",
                "--model-arg",
                "use_shared_rel_pos_bias=true",
                "--model-arg",
                "use_rel_pos_bias=false",
                "--model-arg",
                "img_size=32",
                "--model-arg",
                "patch_size=16",
            ],
            "shares one relative position bias across blocks (Beit",
        ),
        (
            ["compress", "cait_xxs24_224", "--no-pretrained", "--model-arg", "depth=2"],
            "talking-heads attention mixes the heads' logits",
        ),
        (
            ["compress", "swinv2_tiny_window8_256", "--no-pretrained"],
            "timm SwinTransformerV2: its blocks are post-norm",
        ),
        (
            ["compress", "vit_relpos_medium_patch16_rpn_224", "--no-pretrained"],
            "ResPostRelPosBlock, not timm's pre-norm RelPosBlock",
        ),
        (["compress", "vit_srelpos_small_patch16_224", "--no-pretrained"], "shares one relative position bias"),
        ([*base, "--s", "1.0"], "must be in [0, 1)"),
        ([*base, "--s-attn", "-0.2"], "must be in [0, 1)"),
        ([*base, "--ridge", "-1"], "ridge"),
        ([*base, "--round-to", "0"], "'--round-to': 0 is not in the range x>=1"),
        ([*base[:-2], "--calib-samples", "0"], "'--calib-samples': 0 is not in the range 1<=x<=10000000"),
        ([*base, "--calib", str(empty)], "no images"),
        ([*base, "--calib", str(tmp_path / "missing")], "not found"),
        ([*base, "--calib", str(unreadable)], "could be read"),
        (["compress", "deit_tiny", *TINY, "--checkpoint", str(tmp_path / "nope.pth")], "nope.pth: not found"),
        (["compress", "deit_tiny", *TINY, "--checkpoint", str(corrupt)], "cannot read checkpoint"),
        (["compress", "deit_tiny", *TINY, "--checkpoint", str(other)], "does not match the model"),
        ([*base, "--checkpoint", str(other)], "exclude each other"),
        ([*base, "--model-arg", "oops"], "KEY=VALUE"),
        ([*base, "--model-arg", "no_such_argument=3"], "timm cannot build deit_tiny_patch16_224 with"),
        (["compress", "deit_tiny", *TINY, "--calib-samples", "4"], "cannot reach the Hugging Face hub"),
    ]


def test_bad_inputs_give_one_message_and_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("corp_deploy.models._hub_reachable", lambda timeout=3.0: False)
    for args, message in bad_inputs(tmp_path):
        out = tmp_path / "out"
        result, text = run([*args, "-o", str(out)])
        assert result.exit_code not in (0, None), (args, text)
        assert message in text, (args, text)
        assert "Traceback" not in text, (args, text)
        assert not out.exists() and not (tmp_path / "corp-deploy").exists(), args
        assert not list(tmp_path.glob(".out*")), args


@pytest.mark.parametrize(
    "args, message, status",
    [
        (["--macs", "0"], "MAC budget --macs must be a fraction of the dense MACs in (0, 1]", 2),
        (["--macs", "1.5"], "MAC budget --macs must be a fraction of the dense MACs in (0, 1]", 2),
        (["--speedup", "0.5"], "speedup budget --speedup must be a finite number >= 1", 2),
        (["--macs", "0.6", "--speedup", "2"], "as --macs or as --speedup, not both", 2),
        (["--macs", "0.6", "--s", "0.5"], "exclude each other", 2),
        (["--speedup", "2", "--s-vo", "0.5"], "exclude each other", 2),
        (["--macs", "0.02"], "its floor (10% of its dims, at least 1 dim) the model still needs", 2),
        (["--macs", "0.5", "--unit-floor", "1"], "(100% of its dims, at least 1 dim) the model still", 2),
        (["--macs", "0.5", "--unit-floor", "1.5"], "--unit-floor must be in [0, 1]", 2),
        (["--macs", "0.6", "--method", "vbp"], "--macs applies to --method corp only", 2),
        (
            ["--s", "0.5", "--equal-head-dims"],
            "--equal-head-dims ties value dims to query/key dims; it needs --target all",
            2,
        ),
        (["--target", "all", "--s-attn", "0.5", "--s-vo", "0.25", "--equal-head-dims"], "must then be equal", 2),
        (["--s-vo", "0.3"], "--s-vo has no effect with --target both, which prunes mlp and qk only", 2),
        (["--target", "mlp", "--s-attn", "0.9"], "--s-attn has no effect with --target mlp", 2),
        (["--target", "attn", "--s-mlp", "0.9"], "--s-mlp has no effect with --target attn", 2),
        (["--refit", "fc2", "--no-compensation"], "add --refit none", 2),
    ],
)
def test_bad_budgets_give_one_message_and_leave_nothing(tmp_path, args, message, status):
    out = tmp_path / "out"
    result, text = run(
        ["compress", "deit_tiny", "--no-pretrained", *TINY, "--calib-samples", "4", *args, "-o", str(out)]
    )
    assert result.exit_code == status and message in text and "Traceback" not in text, (args, text)
    assert not out.exists()


def test_budget_compress_prints_the_allocation_and_draws_it(tmp_path):
    out = tmp_path / "out"
    result, text = run(
        [
            "compress",
            "deit_tiny",
            "--no-pretrained",
            *TINY,
            "--calib-samples",
            "8",
            "--macs",
            "0.6",
            "--round-to",
            "2",
            "-o",
            str(out),
        ]
    )
    assert result.exit_code == 0, text
    assert "budget 0.6 of the dense MACs" in text and "query/key dims" in text
    allocation = read_config(out).allocation
    assert allocation["planned_macs"] <= allocation["budget_macs"] and len(allocation["units"]) == 6
    assert (out / "allocation.png").stat().st_size > 10_000
    model = load_compressed(out)
    assert [b.mlp.fc1.out_features for b in model.blocks] == [u["kept"] for u in allocation["units"][::3]]


def test_the_state_folder_follows_the_environment_and_ignores_a_relative_xdg_state_home(tmp_path, monkeypatch):
    """A relative ``$XDG_STATE_HOME`` is invalid by the XDG Base Directory specification (it would
    move with the current directory): ignored, as an unset one."""
    from corp_deploy.latest import state_dir

    assert state_dir() == tmp_path / "state"
    monkeypatch.delenv("CORP_DEPLOY_STATE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_dir() == tmp_path / "xdg" / "corp-deploy"
    monkeypatch.setenv("XDG_STATE_HOME", "relstate")
    assert state_dir() == tmp_path / "home" / ".local" / "state" / "corp-deploy"
    monkeypatch.setenv("HOME", "")  # not the file system's root: no state at all
    assert state_dir() is None
