"""Every supported timm family, small and with random weights: compress (uniform sparsity and a
MAC budget), artifact round trip, ONNX export with ONNX Runtime parity, and params and MACs
against an independent count (torch's FlopCounterMode, which counts the aten ops)."""

import copy
import math
import pkgutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors import safe_open
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from corp_deploy import (
    CompressConfig,
    CorpError,
    GatedLinear,
    PrunedAttention,
    blocks_of,
    compress,
    count_macs,
    load_compressed,
    save_artifact,
    standard_form,
)
from corp_deploy.blocks import attention_output, block_forward
from corp_deploy.config import TARGET_PARTS
from corp_deploy.families import FAMILIES as REGISTRY
from corp_deploy.families import Family, TokenGroups, examples, family_of, supported_table, token_groups
from corp_deploy.families.record import WHOLE_SEQUENCE
from corp_deploy.layers import keep_rows
from corp_deploy.methods.corp import qk_pruning
from corp_deploy.methods.corp.qk_statistics import HeadGrams
from corp_deploy.recovery import RecoveryConfig, recover
from exporters import ExportOptions, export_artifact

#: Every family's small test models (each family module names its own), by test id.
FAMILIES = examples()


def create_dense(family: str) -> torch.nn.Module:
    """The family's small model with random weights, seeded; the parameters timm initialises to
    constants (BEiT's relative position tables, BEiT's and Eva's query/value biases, residual
    scales) are drawn at random too, so that dropping or misplacing one changes the output."""
    name, kwargs = FAMILIES[family].model, FAMILIES[family].kwargs
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith(("relative_position_bias_table", "q_bias", "v_bias", "gamma_1", "gamma_2")):
                parameter.normal_(0.0, 0.5)
    return model


def family_config(family: str, kind: str) -> CompressConfig:
    """Uniform s = 0.5 (``kind`` "s0.5") or a 0.9 MAC budget ("macs0.9") of the parts the family allows."""
    target = FAMILIES[family].target
    if kind == "macs0.9":
        return CompressConfig.from_settings(macs=0.9, target=target)
    return CompressConfig(target=target, sparsity=0.5)  # every part the target prunes


def independent_macs(model: torch.nn.Module, image_size: int) -> int:
    """torch's own count of the matmuls and convolutions one image runs through. Counted under
    SDPA's math kernel, which computes attention with counted matmuls on every CPU: which fused
    kernel torch picks otherwise depends on the CPU, and FlopCounterMode does not count every one
    (``_scaled_dot_product_flash_attention_for_cpu``, picked on AVX2 machines, counted 0 in torch 2.14)."""
    # (a frozen copy: FlopCounterMode's module tracker fails on CaiT's class token otherwise, and
    # freezing the parameters changes CaiT's float32 output in the last bits, measured)
    model = copy.deepcopy(model).requires_grad_(False)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size))
    return counter.get_total_flops() // 2


@pytest.mark.parametrize("backend", [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
def test_mac_counts_do_not_depend_on_the_attention_kernel(backend):
    """The product's count (hooks and formulas) and the test oracle (pinned to the math kernel) give
    the same number whichever SDPA kernel the surrounding code would pick, and it includes the
    attention matmuls (2 blocks x 3 heads x 17^2 tokens x (64 + 64) dims for this ViT)."""
    dense = create_dense("vit")
    with sdpa_kernel([backend]):
        counted, oracle = count_macs(dense, (3, 32, 32)), independent_macs(dense, 32)
    linear_and_conv = (
        sum(
            m.in_features * m.out_features * 17
            for m in dense.modules()
            if isinstance(m, torch.nn.Linear) and m is not dense.head
        )
        + 192 * 3 * 8 * 8 * 16
        + 192 * 10
    )
    assert counted == oracle == linear_and_conv + 2 * 3 * 17**2 * (64 + 64)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kind", ["s0.5", "macs0.9"])
def test_family_compresses_round_trips_and_exports(family, kind, tmp_path):
    name, kwargs, size = FAMILIES[family].model, FAMILIES[family].kwargs, FAMILIES[family].size
    config = family_config(family, kind)
    dense = create_dense(family)
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(8, 3, size, size, generator=generator) for _ in range(2)]
    model, report = compress(dense, images, config)

    assert report["macs"]["dense"] == independent_macs(dense, size)
    assert report["macs"]["compressed"] == independent_macs(model, size) == count_macs(model, (3, size, size))
    assert report["macs"]["compressed"] < report["macs"]["dense"]
    if config.options.macs is not None:
        assert report["macs"]["compressed"] <= config.options.macs * report["macs"]["dense"]

    artifact = save_artifact(
        model,
        tmp_path / "art",
        base_model={"name": name, "model_kwargs": kwargs, "weights": {"source": "random", "seed": 0}},
        report=report,
    )
    with safe_open(str(artifact / "model.safetensors"), "pt") as weights:
        stored = sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
    parameter_names = {name for name, _ in model.named_parameters()}
    buffers = sum(v.numel() for name, v in model.state_dict().items() if name not in parameter_names)
    assert report["params"]["compressed"] + buffers == stored
    loaded = load_compressed(artifact)
    with torch.no_grad():
        assert torch.equal(loaded(images[0]), model(images[0]))

    result = export_artifact(artifact, tmp_path / "out", ExportOptions())
    for numbers in result.manifest.models["model"].parity["onnxruntime_vs_pytorch"].values():
        assert numbers["max_abs"] < 1e-4, numbers


def zero_sparsity_configs(family: str) -> list[CompressConfig]:
    """Every method that applies to the family on every part it prunes that the family allows, at sparsity 0."""
    target, methods = FAMILIES[family].target, FAMILIES[family].methods
    parts = TARGET_PARTS[target or "all"]
    configs = [CompressConfig(target=target or "all", s_mlp=0.0, s_attn=0.0, s_vo=0.0)]
    if "vbp" in methods:
        configs.append(CompressConfig(method="vbp", s_mlp=0.0))
    if "toast" in methods:
        configs.append(CompressConfig(method="toast", target="both" if "qk" in parts else "mlp", s_mlp=0.0, s_attn=0.0))
    return configs


@pytest.mark.parametrize(
    "family, config",
    [(family, config) for family in sorted(FAMILIES) for config in zero_sparsity_configs(family)],
    ids=lambda v: v if isinstance(v, str) else f"{v.method}-{v.target}",
)
def test_every_method_at_zero_sparsity_reproduces_the_dense_model(family, config):
    """Nothing pruned: the compressed model of every method computes what the dense one does,
    whatever the family adds (a relative position bias, a CNN stem, a rotary embedding, gates), and
    has as many parameters."""
    size = FAMILIES[family].size
    dense = create_dense(family)
    images = [torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(2))]
    model, report = compress(dense, images, config)
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x), rtol=1e-5, atol=1e-5)
    # counted in the same (standard) form: nothing pruned, nothing removed
    assert report["params"]["compressed"] == report["params"]["dense"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recovery_compares_each_block_with_the_dense_block_it_came_from(family):
    """Recovery's loss compares every block of the compressed model with the same block of the
    dense one, in the same form (a compressed Swin block ends with the next stage's patch merging,
    timm's does not): a student that is the dense model in that form starts with a loss of zero up
    to float rounding, the pooled outputs' term included."""
    size = FAMILIES[family].size
    dense = create_dense(family)
    images = [torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(2))]
    config = RecoveryConfig(steps=1, eval_every=1, pooled_weight=1.0)
    report = recover(standard_form(copy.deepcopy(dense)), dense, images, config)
    first = report["curve"][1]
    assert first["step"] == 1 and abs(first["loss"]) < 1e-5, first


#: Each family's relative position bias ``(1, H, N, N)`` of a dense block, read with timm's own code.
DENSE_BIAS = {
    "relpos": lambda block: block.attn.rel_pos.get_bias(),
    "beit": lambda block: block.attn._get_rel_pos_bias(),
}


@pytest.mark.parametrize("family", sorted(DENSE_BIAS))
@pytest.mark.parametrize(
    "config",
    [
        CompressConfig(target="all", s_mlp=0.5, s_attn=0.5, s_vo=0.5),
        CompressConfig(method="toast", s_mlp=0.5, s_attn=0.5),
    ],
    ids=["corp", "toast"],
)
def test_pruned_attention_keeps_the_relative_position_bias(family, config):
    size = FAMILIES[family].size
    dense = create_dense(family)
    model, _ = compress(dense, [torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(2))], config)
    for block, dense_block in zip(model.blocks, dense.blocks):
        assert isinstance(block.attn, PrunedAttention)
        torch.testing.assert_close(block.attn.logit_bias(), DENSE_BIAS[family](dense_block), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["beit", "eva02", "dinov3", "eva02-sub-ln", "eva-clip", "cait", "vit-swiglu"])
def test_standard_form_computes_what_timm_computes(family):
    """BEiT, Eva and CaiT rewritten as pre-norm blocks (fused qkv bias [q | 0 | v], table bias module
    or rotary embedding inside the attention, LayerScale residuals) and gated MLPs as GatedLinear
    give timm's output bit for bit."""
    dense = create_dense(family)
    standard = standard_form(copy.deepcopy(dense))
    assert all(
        type(block).__name__ == "ScaledResidualBlock" or isinstance(block.mlp.fc1, GatedLinear)
        for block in standard.blocks
    )
    size = FAMILIES[family].size
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(standard(x), dense(x))
    assert standard_form(standard) is standard  # a second rewrite changes nothing


def test_kept_rows_of_a_gated_linear_are_its_kept_channels():
    torch.manual_seed(5)
    gate, up = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    layer = GatedLinear(gate, up, torch.nn.SiLU())
    kept = torch.tensor([0, 3, 4])
    x = torch.randn(2, 7, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(keep_rows(layer, kept)(x), layer(x)[..., kept])  # float32 matmuls
    assert keep_rows(layer, count=2).out_features == 2


@pytest.mark.parametrize(
    "family, target, message",
    [
        ("eva02", "all", "--target mlp-vo"),  # rotary embedding: query/key dims stay dense
        ("eva02-sub-ln", "mlp-vo", "sub-LN"),  # normalised hidden channels: the MLP stays dense
        ("cait", "both", "talking-heads attention"),  # heads mixed around the softmax: attention stays dense
    ],
)
def test_parts_without_exact_compensation_are_refused_saying_what_works(family, target, message):
    size = FAMILIES[family].size
    with pytest.raises(CorpError, match=message):
        compress(
            create_dense(family),
            [torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(6))],
            CompressConfig(target=target, sparsity=0.5),
        )


def test_swin_standard_form_computes_what_timm_computes():
    """Swin blocks as WindowedBlocks (full-width PrunedAttention holding the bias table, the shift
    and mask in ShiftedWindows, patch merging moved to the end of the block before it) give timm's
    output; float32 rounding differs (timm's explicit softmax against SDPA), not more."""
    dense = create_dense("swin")
    standard = standard_form(copy.deepcopy(dense))
    blocks = blocks_of(standard)
    assert [type(b).__name__ for b in blocks] == ["WindowedBlock"] * 4
    assert [any(b.windows.shift) for b in blocks] == [False, True, False, False]  # stage 2 fits in one window
    assert type(blocks[1].transition).__name__ == "PatchMerging"
    assert isinstance(standard.layers[1].downsample, torch.nn.Identity)
    x = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(standard(x), dense(x))
    assert standard_form(standard) is standard and len(blocks_of(standard)) == 4
    for block, timm_block in zip(blocks, [b for stage in dense.layers for b in stage.blocks]):
        torch.testing.assert_close(block.attn.logit_bias(), timm_block.attn._get_rel_pos_bias(), rtol=0, atol=0)


def test_swin_query_key_statistics_are_those_of_the_logits_inside_the_shift_mask():
    """In a shifted-window block the statistics of docs/method.md §3 are summed over the groups of
    tokens that attend to each other (window x region), so the compensation M is the least-squares
    fit of exactly the logits the mask lets through: checked against lstsq on those logits, computed
    with timm's own roll, window partition and mask."""
    dense = create_dense("swin")
    timm_block = dense.layers[0].blocks[1]
    block = blocks_of(standard_form(copy.deepcopy(dense)))[1]
    x = torch.randn(2, 14, 14, 32, generator=torch.Generator().manual_seed(7))
    grams = HeadGrams()
    with torch.no_grad():
        attention_output(block, block.norm1(x), on_heads=grams.add)
        shifted = torch.roll(timm_block.norm1(x), shifts=(-3, -3), dims=(1, 2))
        windows = timm.models.swin_transformer.window_partition(shifted, (7, 7)).reshape(-1, 49, 32)
        q, k, _ = timm_block.attn.qkv(windows).double().reshape(-1, 49, 3, 2, 16).permute(2, 3, 0, 1, 4)
    allowed = (timm_block.attn_mask == 0).repeat(2, 1, 1)  # (images x windows, 49, 49)
    S, P = torch.arange(0, 16, 2), torch.arange(1, 16, 2)
    for h, sums in enumerate(grams.heads()):
        solution = qk_pruning.solve_head(sums, S, P, alpha=0.0)
        design, target = [], []
        for w in range(allowed.shape[0]):
            i, j = allowed[w].nonzero(as_tuple=True)
            qs, ks = q[h, w][:, S], k[h, w][:, S]
            design.append((qs[i, :, None] * ks[j, None, :]).reshape(len(i), -1))  # vec(q_S,i k_S,j^T), row-major
            target.append((q[h, w][i][:, P] * k[h, w][j][:, P]).sum(-1))
        m = torch.linalg.lstsq(torch.cat(design), torch.cat(target)[:, None]).solution.reshape(8, 8)
        torch.testing.assert_close(solution.M, m, rtol=1e-4, atol=1e-6)  # float32 activations, float64 solves


def test_swin_refuses_toast_and_keeps_bias_and_mask_when_pruned():
    dense = create_dense("swin")
    images = [torch.randn(4, 3, 56, 56, generator=torch.Generator().manual_seed(2))]
    with pytest.raises(CorpError, match="not implemented for Swin"):
        compress(dense, images, CompressConfig(method="toast", s_mlp=0.5))
    model, _ = compress(dense, images, CompressConfig(target="all", s_mlp=0.5, s_attn=0.5, s_vo=0.5))
    for block, timm_block in zip(blocks_of(model), [b for stage in dense.layers for b in stage.blocks]):
        assert (block.attn.qk_head_dim, block.attn.v_head_dim) == (8, 8)
        torch.testing.assert_close(block.attn.logit_bias(), timm_block.attn._get_rel_pos_bias(), rtol=0, atol=0)
        if timm_block.attn_mask is None:
            assert block.windows.mask is None
        else:
            assert torch.equal(block.windows.mask, timm_block.attn_mask)


def test_token_groups_are_one_sequence_per_image_unless_the_family_says_otherwise():
    """A ViT block's tokens are one whole sequence per image: attention in place, every part counts
    the tokens given, the block hands them on as they are. A Swin block's are its windows: attention
    not in place, its own feature map's counts (padded to whole windows for attention, a window's
    tokens as keys) whatever the tokens given, its patch merging on the way out."""
    vit = create_dense("vit")
    groups = token_groups(blocks_of(standard_form(vit))[0])
    tokens = vit.patch_embed.num_patches + vit.num_prefix_tokens
    x = torch.randn(2, tokens, vit.embed_dim)
    assert groups is WHOLE_SEQUENCE and groups.in_place
    assert groups.exit(x) is x and groups.group_heads(x) is x
    assert groups.counts(tokens) == (tokens, tokens, tokens)
    blocks = blocks_of(standard_form(create_dense("swin")))
    first, merging, last = (token_groups(blocks[i]) for i in (0, 1, 3))
    assert not first.in_place and first.description == "Swin's windowed feature maps"
    assert first.counts(tokens) == (14 * 14, 14 * 14, 7 * 7) and last.counts(tokens) == (7 * 7, 7 * 7, 7 * 7)
    x = torch.randn(2, 14, 14, 32)
    with torch.no_grad():
        assert torch.equal(merging.exit(x), blocks[1].transition(x)) and first.exit(x) is x


def test_blocks_and_methods_ask_the_family_how_a_block_groups_its_tokens(monkeypatch):
    """A family's token groups are what the rest of the library goes by, for any family: here a
    family that claims one ViT block, whose tokens leave it halved and whose attention is not in
    place, so block_forward halves its output and toast refuses the model in the family's words."""

    class Halved(TokenGroups):
        in_place = False
        description = "halved tokens"

        def exit(self, x: torch.Tensor) -> torch.Tensor:
            return x / 2

    import corp_deploy.families as package

    dense = create_dense("vit")
    block = blocks_of(dense)[0]
    block.halved = True  # (compress works on a copy)
    halving = Family(
        "halving",
        "a test family",
        matches=lambda model: False,
        problem=lambda model: None,
        token_groups=lambda b: Halved() if getattr(b, "halved", False) else None,
    )
    monkeypatch.setattr(package, "FAMILIES", (halving, *REGISTRY))
    x = torch.randn(2, dense.patch_embed.num_patches + dense.num_prefix_tokens, dense.embed_dim)
    with torch.no_grad():
        torch.testing.assert_close(block_forward(block, x), block(x) / 2, rtol=0, atol=0)
    images = [torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))]
    with pytest.raises(CorpError, match="toast samples tokens of a token sequence and is not implemented for halved"):
        compress(dense, images, CompressConfig(method="toast", s_mlp=0.5))


def test_docs_table_of_supported_models_is_the_registry_s():
    page = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    assert supported_table() in page


def test_every_family_module_is_registered_and_its_examples_belong_to_it():
    """A module added to corp_deploy/families/ is in the registry, each supported family has a test
    model, and each test model is matched by the family that names it (and by no earlier one)."""
    import corp_deploy.families as package

    helpers = {"record", "shared"}
    modules = {info.name for info in pkgutil.iter_modules(package.__path__)} - helpers
    assert modules == {family.name for family in REGISTRY if family.supported}
    for family in REGISTRY:
        assert bool(family.examples) == family.supported, family.name
        for key in family.examples:
            assert family_of(create_dense(key)) is family, key


def test_separate_query_key_value_projections_keep_every_bias_in_the_standard_form():
    """An Eva attention with separate q/k/v projections whose key projection has a bias (timm builds it
    without one; a checkpoint may carry one) computes the same after the rewrite into one fused qkv."""
    dense = create_dense("eva02-sub-ln")
    with torch.no_grad():
        for block in dense.blocks:
            old = block.attn.k_proj
            block.attn.k_proj = torch.nn.Linear(old.in_features, old.out_features)
            block.attn.k_proj.weight.copy_(old.weight)
            block.attn.k_proj.bias.normal_(0.0, 0.5)
    standard = standard_form(copy.deepcopy(dense))
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():  # the features (the random head's outputs are too small to show a difference)
        torch.testing.assert_close(standard.forward_features(x), dense.forward_features(x), rtol=1e-5, atol=1e-5)
