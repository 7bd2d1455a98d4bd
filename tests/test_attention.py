"""Query/key compensation against raw per-image activations (docs/method.md §3)."""

import pytest
import scipy.linalg
import torch
from timm.layers.attention import Attention

from corp_deploy.layers import PrunedAttention
from corp_deploy.methods.corp import qk_pruning
from corp_deploy.methods.corp.qk_statistics import HeadGrams, ImageGrams, KroneckerSums, pack

#: The two forms of the query/key sums (corp_deploy/methods/corp/qk_statistics.py): every solver test runs on both.
FORMS = ("images", "summed")
N_IMAGES, TOKENS, DIM, HEADS = 12, 10, 24, 2  # head dim 12


def attention_with_bias(seed=0):
    torch.manual_seed(seed)
    attn = Attention(DIM, num_heads=HEADS, qkv_bias=True).eval()
    with torch.no_grad():
        attn.qkv.bias.normal_(0, 0.5)
    return attn


def raw_qk(attn, x):
    """Q, K of shape (images, heads, tokens, d) float64."""
    B, N, _ = x.shape
    qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    return qkv[0].double(), qkv[1].double()


def setup(seed=0, kept=7, form="images"):
    """The attention, its input, raw Q and K ``(images, heads, tokens, d)`` float64, the heads'
    sums in ``form`` (collected in three batches) and the kept/pruned dims."""
    attn = attention_with_bias(seed)
    x = torch.randn(N_IMAGES, TOKENS, DIM, generator=torch.Generator().manual_seed(seed + 10))
    with torch.no_grad():
        q, k = raw_qk(attn, x)
    grams = HeadGrams(summed_after=5 if form == "summed" else None)  # the switch comes after batch 2
    for qb, kb in zip(q.float().split(4), k.float().split(4)):
        grams.add(qb, kb)
    assert (grams.kronecker is not None) == (form == "summed")
    sums = grams.heads()
    S, P = qk_pruning.split_head_dims(qk_pruning.qk_dim_scores(sums), kept)
    return attn, x, q, k, sums, S, P


def symmetric_grams(n, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, d, dtype=torch.float64, generator=gen)
    g = torch.randn(n, d, d, dtype=torch.float64, generator=gen)
    return a + a.transpose(1, 2), g + g.transpose(1, 2)


@pytest.mark.parametrize("form", FORMS)
def test_every_sum_matches_explicit_kronecker_products(form):
    a, g = symmetric_grams(5, 4)
    sums = ImageGrams(a, g) if form == "images" else KroneckerSums(pack(a).T @ pack(g), 5, 4)
    expected = sum(torch.kron(a[i], g[i]) for i in range(5))  # row (p, q) = p * 4 + q
    every = torch.arange(4)
    torch.testing.assert_close(sums.kronecker(every.repeat_interleave(4), every.repeat(4)), expected)
    p, q = torch.tensor([3, 0, 2]), torch.tensor([1, 1, 3])  # a subset of pairs in any order
    torch.testing.assert_close(sums.kronecker(p, q), expected[p * 4 + q][:, p * 4 + q])
    torch.testing.assert_close(sums.products(), (a * g).sum(0))
    assert sums.trace_product() == pytest.approx(float(torch.trace(expected)), rel=1e-12)
    inner, outer = torch.tensor([1, 3]), torch.tensor([2, 0, 3])
    torch.testing.assert_close(sums.cross(inner, outer), (a[:, outer][:, :, inner] @ g[:, inner][:, :, outer]).sum(0))


def test_summed_and_per_image_forms_solve_the_same_system():
    """The Kronecker sums (after the switch) and the per-image Grams differ only in float64
    summation order."""
    *_, by_image, S, P = setup()
    *_, summed, S2, P2 = setup(form="summed")
    assert torch.equal(S, S2) and torch.equal(P, P2)
    for h in range(HEADS):
        one, other = (qk_pruning.solve_head(sums[h], S[h], P[h], alpha=1e-3) for sums in (by_image, summed))
        torch.testing.assert_close(one.M, other.M, rtol=1e-9, atol=1e-12)
        for name in ("ridge_lambda", "error_uncompensated", "error_compensated", "logit_energy"):
            assert getattr(one, name) == pytest.approx(getattr(other, name), rel=1e-9), name


@pytest.mark.parametrize("form", FORMS)
def test_ranking_is_per_image_logit_energy(form):
    attn, x, q, k, sums, S, P = setup(form=form)
    expected = ((q**2).sum(2) * (k**2).sum(2)).mean(0)  # (heads, d)
    torch.testing.assert_close(qk_pruning.qk_dim_scores(sums), expected, rtol=1e-5, atol=1e-6)
    for h in range(HEADS):
        assert expected[h, S[h]].min() >= expected[h, P[h]].max()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("alpha", [0.0, 1e-2])
def test_solution_satisfies_normal_equations(alpha, form):
    attn, x, q, k, sums, S, P = setup(form=form)
    for h in range(HEADS):
        sol = qk_pruning.solve_head(sums[h], S[h], P[h], alpha)
        qs, qp = q[:, h][..., S[h]], q[:, h][..., P[h]]
        ks, kp = k[:, h][..., S[h]], k[:, h][..., P[h]]
        A, G = qs.transpose(1, 2) @ qs, ks.transpose(1, 2) @ ks
        C = (qs.transpose(1, 2) @ qp) @ (kp.transpose(1, 2) @ ks)
        lhs = (A @ sol.M @ G).sum(0) + sol.ridge_lambda * sol.M
        torch.testing.assert_close(lhs, C.sum(0), rtol=1e-4, atol=1e-4 * float(C.abs().max()))


@pytest.mark.parametrize("form", FORMS)
def test_solution_equals_least_squares_on_raw_logits(form):
    attn, x, q, k, sums, S, P = setup(form=form)
    for h in range(HEADS):
        sol = qk_pruning.solve_head(sums[h], S[h], P[h], alpha=0.0)
        qs, qp = q[:, h][..., S[h]], q[:, h][..., P[h]]
        ks, kp = k[:, h][..., S[h]], k[:, h][..., P[h]]
        # vec(Q_S M K_S^T) = (Q_S kron K_S) vec(M), row-major, stacked over images
        design = torch.cat([torch.kron(qs[i], ks[i]) for i in range(N_IMAGES)])
        target = torch.cat([(qp[i] @ kp[i].T).reshape(-1) for i in range(N_IMAGES)])
        m = torch.linalg.lstsq(design, target.unsqueeze(1)).solution.reshape(len(S[h]), len(S[h]))
        torch.testing.assert_close(sol.M, m, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("form", FORMS)
def test_reported_errors_are_the_actual_logit_errors_and_compensation_helps(form):
    attn, x, q, k, sums, S, P = setup(form=form)
    for h in range(HEADS):
        sol = qk_pruning.solve_head(sums[h], S[h], P[h], alpha=1e-3)
        qs, ks = q[:, h][..., S[h]], k[:, h][..., S[h]]
        full = q[:, h] @ k[:, h].transpose(1, 2)
        sliced = qs @ ks.transpose(1, 2)
        comp = qs @ (torch.eye(len(S[h]), dtype=q.dtype) + sol.M) @ ks.transpose(1, 2)
        err_slice = float(((full - sliced) ** 2).sum()) / N_IMAGES
        err_comp = float(((full - comp) ** 2).sum()) / N_IMAGES
        assert sol.error_uncompensated == pytest.approx(err_slice, rel=1e-4)
        assert sol.error_compensated == pytest.approx(err_comp, rel=1e-3)
        assert sol.logit_energy == pytest.approx(float((full**2).sum()) / N_IMAGES, rel=1e-4)
        assert err_comp < err_slice


def test_identity_plus_factorisation_is_not_symmetrised_and_is_the_polar_split():
    m = 0.3 * torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = torch.eye(6, dtype=torch.float64) + m
    u, v = qk_pruning.factor_identity_plus(m)
    torch.testing.assert_close(u @ v.T, a)
    # independent: scipy's polar decomposition a = w p and the principal square root of p
    w, p = scipy.linalg.polar(a.numpy())
    root = scipy.linalg.sqrtm(p).real
    torch.testing.assert_close(v, torch.from_numpy(root))
    torch.testing.assert_close(u, torch.from_numpy(w @ root))
    u0, v0 = qk_pruning.factor_identity_plus(torch.zeros(3, 3, dtype=torch.float64))
    assert torch.equal(u0, torch.eye(3, dtype=torch.float64)) and torch.equal(v0, u0)


def test_identity_plus_factorisation_does_not_depend_on_the_svd_chosen(monkeypatch):
    """LAPACK and cuSOLVER may return other signs for the singular vector pairs, and any rotation
    within equal singular values: the split must be the same."""
    m = 0.3 * torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    u, v = qk_pruning.factor_identity_plus(m)
    svd = torch.linalg.svd
    flip = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)

    def flipped_svd(a):
        r, sig, th = svd(a)
        return r * flip, sig, flip[:, None] * th

    monkeypatch.setattr(qk_pruning.torch.linalg, "svd", flipped_svd)
    u_flipped, v_flipped = qk_pruning.factor_identity_plus(m)
    torch.testing.assert_close(u_flipped, u)
    torch.testing.assert_close(v_flipped, v)
    monkeypatch.setattr(qk_pruning.torch.linalg, "svd", svd)
    # I + M orthogonal: every singular value is 1 and the SVD's vectors are arbitrary; U = I + M, V = I
    q, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    u_q, v_q = qk_pruning.factor_identity_plus(q - torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(u_q, q)
    torch.testing.assert_close(v_q, torch.eye(6, dtype=torch.float64))


def test_folded_logits_equal_compensated_logits_including_biases():
    attn, x, q, k, sums, S, P = setup()
    sols = [qk_pruning.solve_head(sums[h], S[h], P[h], alpha=1e-3) for h in range(HEADS)]
    pruned = qk_pruning.fold_attention(attn, S, [s.M for s in sols])
    assert isinstance(pruned, PrunedAttention) and pruned.scale == attn.scale
    with torch.no_grad():
        B, N, _ = x.shape
        dq = S.shape[1]
        qkv = pruned.qkv(x)
        q2 = qkv[..., : HEADS * dq].reshape(B, N, HEADS, dq).transpose(1, 2).double()
        k2 = qkv[..., HEADS * dq : 2 * HEADS * dq].reshape(B, N, HEADS, dq).transpose(1, 2).double()
        for h in range(HEADS):
            expected = (
                q[:, h][..., S[h]] @ (torch.eye(dq, dtype=q.dtype) + sols[h].M) @ k[:, h][..., S[h]].transpose(1, 2)
            )
            torch.testing.assert_close(
                attn.scale * q2[:, h] @ k2[:, h].transpose(1, 2), attn.scale * expected, rtol=1e-4, atol=1e-4
            )
        # the module computes softmax(scale * logits) @ V with the original V and proj
        v = attn.qkv(x).reshape(B, N, 3, HEADS, attn.head_dim).permute(2, 0, 3, 1, 4)[2].double()
        logits = attn.scale * q2 @ k2.transpose(-1, -2)
        manual = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, N, -1)
        manual = manual @ attn.proj.weight.double().T + attn.proj.bias.double()
        torch.testing.assert_close(pruned(x).double(), manual, rtol=1e-4, atol=1e-5)


def test_uncompensated_fold_is_slicing_and_zero_sparsity_is_identity():
    attn, x, *_ = setup()
    d = attn.head_dim
    full = torch.arange(d).expand(HEADS, d)
    same = qk_pruning.fold_attention(attn, full, [torch.zeros(d, d, dtype=torch.float64)] * HEADS)
    with torch.no_grad():
        torch.testing.assert_close(same(x), attn(x), rtol=1e-5, atol=1e-6)
