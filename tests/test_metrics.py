"""The output metrics (:mod:`exporters.metrics`) against independent computations."""

import math

import numpy as np
import pytest
import torch

from corp_deploy.metrics import as_rows, cosine, kl_divergence_sum, tensor_cosine, top1_matches


def _rows():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 2, 3)).astype(np.float32)
    b = a + 0.5 * rng.standard_normal((5, 2, 3)).astype(np.float32)
    return a, b


def _cosine_by_hand(x, y):
    dot = sum(float(p) * float(q) for p, q in zip(x, y))
    return dot / (math.sqrt(sum(float(p) ** 2 for p in x)) * math.sqrt(sum(float(q) ** 2 for q in y)))


def test_cosine_of_host_arrays_and_tensors_matches_a_hand_computation():
    a, b = _rows()
    ra, rb = as_rows(a), as_rows(b)
    assert ra.shape == (5, 6) and ra.dtype == np.float64
    expected = [_cosine_by_hand(x, y) for x, y in zip(ra, rb)]
    np.testing.assert_allclose(cosine(ra, rb), expected, rtol=1e-12)
    got = tensor_cosine(torch.from_numpy(ra), torch.from_numpy(rb))
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    assert cosine(np.zeros((1, 3)), np.ones((1, 3)))[0] == 0.0  # a zero row: no division by zero


def test_top1_matches_on_arrays_and_tensors():
    a = np.array([[0.1, 0.9, 0.0], [0.7, 0.2, 0.1], [0.0, 0.0, 1.0]])
    b = np.array([[0.0, 1.0, 0.0], [0.1, 0.2, 0.7], [0.2, 0.1, 0.9]])
    assert top1_matches(a, b).tolist() == [True, False, True]
    assert top1_matches(torch.from_numpy(a), torch.from_numpy(b)).tolist() == [True, False, True]
    a[0, 0] = b[2, 1] = np.nan  # a NaN is nobody's top-1 (argmax would pick it on both sides)
    assert top1_matches(a, a).tolist() == [False, True, True]
    assert (
        top1_matches(a, b).tolist()
        == top1_matches(torch.from_numpy(a), torch.from_numpy(b)).tolist()
        == [False, False, False]
    )


def test_kl_divergence_sum_matches_its_definition():
    p_logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    q_logits = torch.tensor([[0.5, 2.5, 0.0], [1.0, 1.0, 1.0]])
    expected = 0.0
    for p_row, q_row in zip(p_logits.tolist(), q_logits.tolist()):
        p = [math.exp(v) / sum(math.exp(w) for w in p_row) for v in p_row]
        q = [math.exp(v) / sum(math.exp(w) for w in q_row) for v in q_row]
        expected += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    got = kl_divergence_sum(p_logits, q_logits)
    assert got.dtype == torch.float64 and float(got) == pytest.approx(expected, rel=1e-12)
    assert float(kl_divergence_sum(p_logits, p_logits)) == 0.0
