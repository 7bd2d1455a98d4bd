"""The reduced-precision export policy: the same computation, with the fragile parts in float32."""

import pytest
import timm
import torch
from torch import nn

from corp_deploy import CompressConfig, CorpError, compress, standard_form
from exporters.reduced_precision import Float32Island, Float32SoftmaxAttention, for_export


@pytest.fixture(scope="module")
def pruned(small_vit, image_batches):
    model, _ = compress(small_vit(), image_batches(2, 4), CompressConfig(s_mlp=0.5, s_attn=0.5))
    return model


@pytest.mark.parametrize("compressed", [False, True])
def test_explicit_attention_equals_the_module_it_replaces_in_float32(pruned, compressed, small_vit):
    """Written out by hand (layout, unequal q/k and v head dims, fixed scale), the attention
    must compute exactly what timm's Attention / PrunedAttention computes."""
    attn = (pruned if compressed else small_vit()).blocks[0].attn
    x = torch.randn(3, 17, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = attn(x)
        got = Float32SoftmaxAttention.from_module(attn)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


#: A one-block model whose attention adds a position term to the logits: (timm name, arguments,
#: tokens, width, target), and a check that the term is there.
POSITION_TERMS = {
    "relative-bias": (
        (
            "vit_relpos_small_patch16_224",
            dict(img_size=32, patch_size=8, embed_dim=48, depth=1, num_heads=3, num_classes=10),
            16,
            48,
            "all",
        ),
        lambda attn: torch.any(attn.rel_pos.get_bias() != 0),
    ),
    "rotary": (
        ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=7, depth=1, num_classes=10), 17, 192, "mlp-vo"),
        lambda attn: attn.rope is not None and attn.num_prefix_tokens == 1,
    ),
}


@pytest.mark.parametrize("term", sorted(POSITION_TERMS))
@pytest.mark.parametrize("compressed", [False, True])
def test_explicit_attention_keeps_the_position_terms(term, compressed, image_batches):
    (name, kwargs, tokens, width, target), present = POSITION_TERMS[term]
    torch.manual_seed(0)
    model = standard_form(timm.create_model(name, **kwargs).eval())
    if compressed:
        model, _ = compress(
            model,
            image_batches(2, 4, size=kwargs["img_size"]),
            CompressConfig(target=target, sparsity=0.5),
        )
    attn = model.blocks[0].attn
    x = torch.randn(3, tokens, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = attn(x)
        got = Float32SoftmaxAttention.from_module(attn)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert present(attn)


@pytest.mark.parametrize("precision,min_cosine", [("fp16", 0.999), ("bf16", 0.99)])
def test_reduced_precision_model_is_close_and_keeps_fragile_parts_in_float32(
    pruned, precision, min_cosine, image_batches
):
    low = for_export(pruned, precision)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    islands = [m for m in low.modules() if isinstance(m, Float32Island)]
    assert sum(isinstance(m.module, nn.LayerNorm) for m in islands) == 5
    assert sum(isinstance(m.module, nn.Conv2d) for m in islands) == 1
    assert all(p.dtype == torch.float32 for m in islands for p in m.parameters())
    assert low.model.blocks[0].mlp.fc1.weight.dtype == dtype
    assert pruned.blocks[0].mlp.fc1.weight.dtype == torch.float32  # the original is untouched
    x = image_batches(1, 6, seed=2)[0]
    with torch.no_grad():
        ref, out = pruned(x), low(x)
    assert out.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(ref, out, dim=-1).min() > min_cosine
    assert not torch.equal(ref, out)


def test_unsupported_attention_is_refused(small_vit):
    model = small_vit(qk_norm=True)
    with pytest.raises(CorpError, match="qk-norm"):
        for_export(model, "fp16")
    with pytest.raises(CorpError, match="precision must be one of"):
        for_export(small_vit(), "int8")
