"""The label-free recovery after compression (corp_deploy/recovery/): off by default and then
bit-identical to compression alone, structure unchanged, the loss falls, never worse on validation
than compression left it, seeded, and its failures."""

from __future__ import annotations

import contextlib
import copy
import io
import re
from dataclasses import replace

import pytest
import torch

from corp_deploy import CompressConfig, compress, model_transform
from corp_deploy.errors import CorpError, SettingError
from corp_deploy.recovery import (
    Outputs,
    RecoveryConfig,
    RecoveryImages,
    _Distillation,
    check_teacher,
    distillation_loss,
    recover,
    recovery_table,
    trainable_parameters,
)
from corp_deploy.recovery.images import training_batches
from corp_deploy.recovery.validation import Validation


def table_text(report: dict) -> str:
    """:func:`recovery_table` of ``report`` as plain text."""
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(recovery_table(report))
    return console.export_text()


#: A recovery that measurably learns on the small ViT within a few seconds.
QUICK = RecoveryConfig(steps=40, lr=3e-3, batch_size=8, eval_every=10, patience=10)


@pytest.fixture
def images(image_batches):
    return image_batches(4, 8, seed=5)


def compressed(vit, images, **settings):
    return compress(vit, images, CompressConfig.from_settings(s_mlp=0.75, s_attn=0.75, **settings))


def test_zero_steps_is_compression_alone(small_vit, images):
    plain, plain_report = compressed(small_vit(), images)
    off, off_report = compressed(small_vit(), images, recover_steps=0)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(off.state_dict()[name], tensor), name
    assert "recovery" not in off_report
    assert CompressConfig.from_settings(recover_steps=0).to_dict() == CompressConfig().to_dict()


def test_recovery_keeps_the_structure_and_improves_validation(small_vit, images):
    """The same dims and parameter count; the loss falls; the kept weights are those of the best
    validation measurement, which beats compression's (here a plain slice: on random weights and
    images CORP's compensation leaves too little to recover)."""
    before, before_report = compressed(small_vit(), images, compensation=False)
    sliced = CompressConfig(s_mlp=0.75, s_attn=0.75, compensation=False, recovery=QUICK)
    model, report = compress(small_vit(), images, sliced)
    recovery = report["recovery"]
    assert [layer["dims"] for layer in report["layers"]] == [layer["dims"] for layer in before_report["layers"]]
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in before.state_dict().items()}
    losses = [row["loss"] for row in recovery["curve"][1:]]
    assert losses[-1] < losses[0]
    cosine = recovery["validation_cosine"]
    assert recovery["best_step"] > 0 and cosine["recovered"] > cosine["compressed"]
    assert f"{cosine['compressed']:.4f} -> {cosine['recovered']:.4f}" in table_text(recovery)
    assert recovery["images"] == {
        "training_sources": 28,
        "validation_sources": 4,
        "validation_views": 32,
        "duplicate_sources": 0,
    } and report["params"]["compressed"] == sum(p.numel() for p in model.parameters())
    # never trained; nor is the final norm by default (no final-features term in the loss)
    for name in ("patch_embed.proj.weight", "pos_embed", "cls_token", "head.weight", "norm.weight", "norm.bias"):
        assert torch.equal(model.state_dict()[name], before.state_dict()[name]), name


def test_a_recovery_that_keeps_no_step_leaves_the_model_compress_gives_without_it(small_vit, images):
    """A learning rate far too high makes every measurement worse: no step is kept, and the model is
    exactly what compress gives without recovery (compressed again on all the images, the
    validation sources included), also in place, trainable as compress leaves it."""
    harmful = RecoveryConfig(steps=6, lr=0.5, batch_size=8, eval_every=2, patience=2, warmup=0.0)
    fitted = RecoveryImages(images, model_transform(small_vit())[1], harmful).fit_batches()
    assert sum(len(batch) for batch in fitted) == 28  # of 32: 4 held out
    expected, _ = compressed(small_vit(), images)
    config = CompressConfig(s_mlp=0.75, s_attn=0.75, recovery=harmful)
    for in_place in (False, True):
        model, report = compress(small_vit(), images, config, in_place=in_place)
        recovery = report["recovery"]
        assert recovery["best_step"] == 0 and recovery["stopped"] == "validation did not improve in 2 measurements"
        assert recovery["steps_run"] == 4 and report["calibration"]["images"] == 32
        shown = table_text(recovery)  # the cosine before any step only: the model kept was not measured
        assert "none: no measurement beat compression's" in shown and "(before any step)" in shown
        assert "->" not in shown
        assert report["time_s"]["recover"] > 0 and all(p.requires_grad for p in model.parameters())
        for name, tensor in expected.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), name


def test_on_measure_sees_the_student_at_every_validation(small_vit, images):
    """The callback runs at step 0 and at every measurement, on the student being trained."""
    student, _ = compressed(small_vit(), images)
    dense, seen = small_vit(), []
    report = recover(
        student, dense, images, QUICK, on_measure=lambda step, model: seen.append((step, model is student))
    )
    assert seen == [(row["step"], True) for row in report["curve"]] and len(seen) == 5


def test_blend_keeps_that_share_of_the_trained_change(small_vit, images):
    """The kept weights are compression's plus ``blend`` times the trained change (the training
    itself does not depend on it)."""
    start, _ = compressed(small_vit(), images, compensation=False)
    full, half = copy.deepcopy(start), copy.deepcopy(start)
    config = RecoveryConfig(steps=10, lr=3e-3, batch_size=8, eval_every=10, patience=10)
    assert recover(full, small_vit(), images, replace(config, blend=1.0))["best_step"] == 10
    assert recover(half, small_vit(), images, replace(config, blend=0.5))["best_step"] == 10
    changed = 0
    for name, tensor in start.state_dict().items():
        torch.testing.assert_close(half.state_dict()[name], (tensor + full.state_dict()[name]) / 2, msg=name)
        changed += not torch.equal(full.state_dict()[name], tensor)
    assert changed > 10


def test_the_same_seed_gives_the_same_weights(small_vit, images):
    config = CompressConfig(s_mlp=0.75, s_attn=0.75, recovery=RecoveryConfig(steps=6, lr=3e-3, batch_size=8))
    one, _ = compress(small_vit(), images, config)
    two, _ = compress(small_vit(), images, config)
    for name, tensor in one.state_dict().items():
        assert torch.equal(two.state_dict()[name], tensor), name


def test_activation_checkpointing_gives_the_same_weights(small_vit, images):
    """Recomputing the blocks' activations in the backward pass changes memory, not the result."""
    few = RecoveryConfig(steps=4, lr=3e-3, batch_size=8, eval_every=2, patience=10)
    plain, _ = compressed(small_vit(), images, compensation=False)
    checkpointed, _ = compressed(small_vit(), images, compensation=False)
    recover(plain, small_vit(), images, few)
    report = recover(checkpointed, small_vit(), images, RecoveryConfig(**{**vars(few), "checkpointing": True}))
    assert report["best_step"] > 0 and not checkpointed.grad_checkpointing
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(checkpointed.state_dict()[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_a_non_finite_loss_stops_with_the_step(small_vit, images, monkeypatch):
    from corp_deploy.recovery import training

    calls = []

    def poisoned(*args):
        calls.append(1)
        loss = distillation_loss(*args)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(training, "distillation_loss", poisoned)
    with pytest.raises(CorpError, match="recovery stopped at step 3 of 10: the loss is not finite"):
        compress(small_vit(), images, CompressConfig(recovery=RecoveryConfig(steps=10, batch_size=8)))


def test_too_few_batches_for_the_processes_once_validation_is_held_out_says_why(small_vit, images, monkeypatch):
    """Under torch.distributed every process needs a batch of the images compression fits on;
    recovery's validation sources are not among them, and the message says so."""
    import corp_deploy.distributed as distributed

    monkeypatch.setattr(distributed, "world_size", lambda: 5)  # checked before any collective call
    expected = (
        "recovery holds out 4 of the 32 calibration sources for validation, and the 28 images of the others, "
        "which compression fits on, come in 4 batches: fewer than there are processes (5)"
    )
    with pytest.raises(CorpError, match=re.escape(expected)):
        compress(small_vit(), images, CompressConfig(recovery=RecoveryConfig(steps=10, batch_size=8)))


def test_a_teacher_that_is_not_the_dense_model_is_refused(small_vit, images):
    student, _ = compressed(small_vit(), images)
    with pytest.raises(CorpError, match="patch embedding differs"):
        check_teacher(student, small_vit(seed=1))
    with pytest.raises(CorpError, match="blocks"):
        check_teacher(student, small_vit(depth=3))
    check_teacher(student, small_vit())


def test_the_loss_is_zero_for_equal_outputs_and_the_cosine_distances_otherwise():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    p, q = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    same = Outputs([a, a], a, p)
    assert float(distillation_loss(same, same, 1.0, 1.0)) == pytest.approx(0.0, abs=1e-6)

    def distance(s, t):  # 1 - cos over the last dim, in float64, averaged
        return float(
            (1 - (s.double() * t.double()).sum(-1) / (s.double().norm(dim=-1) * t.double().norm(dim=-1))).mean()
        )

    got = distillation_loss(Outputs([a, a], a, p), Outputs([b, a], b, q), 0.5, 2.0)
    expected = distance(a, b) / 2 + 0.5 * distance(a, b) + 2.0 * distance(p, q)
    assert float(got) == pytest.approx(expected, rel=1e-5)


DATA_CONFIG = {"mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3), "input_size": (3, 8, 8)}


def test_validation_holds_out_whole_sources_and_views_are_seeded(tmp_path):
    """Sources (files, each with two crops among the images) are held out whole: the validation
    views are one unseen view of each held-out file, the training views never show one; views of
    the same step are the same, normalised as the calibration images are."""
    from PIL import Image

    paths = []
    for i in range(8):  # file i is one flat grey, 30 * i: every view of it too
        paths.append(tmp_path / f"{i}.png")
        Image.new("RGB", (16, 12), (30 * i,) * 3).save(paths[-1])

    class Batches(list):
        image_sources = [paths[i // 2] for i in range(16)]  # two crops of each file

    batches = Batches([torch.zeros(16, 3, 8, 8)])
    images = RecoveryImages(batches, DATA_CONFIG, RecoveryConfig(validation=0.25, seed=3, batch_size=3))
    assert images.sources == (6, 2)  # 2 of 8 files held out
    mean, std = torch.tensor(DATA_CONFIG["mean"]).view(3, 1, 1), torch.tensor(DATA_CONFIG["std"]).view(3, 1, 1)

    def greys(views):
        return {round(float((view * std + mean).mean()) * 255 / 30) for view in views}

    held = greys(images.validation)
    assert images.validation.shape == (32, 3, 8, 8) and len(held) == 2  # 16 views of each
    plain = RecoveryImages(batches, DATA_CONFIG, RecoveryConfig(validation=0.25, seed=3, color=0.0, mix=0.0))
    trained = set().union(*(greys(plain.training[step]) for step in (1, 2)))  # 16 a step: every file shown
    assert trained == set(range(8)) - held
    assert images.batches == list(batches)  # all of them, for compressing again
    mixed = RecoveryImages(batches, DATA_CONFIG, RecoveryConfig(validation=0.25, seed=3, color=0.0, mix=1.0))
    values = [float((view * std + mean).mean()) * 255 / 30 for view in mixed.training[1]]
    assert all(min(trained) - 1e-4 <= v <= max(trained) + 1e-4 for v in values)  # convex mixtures of them
    assert any(abs(v - round(v)) > 0.01 for v in values)  # not a grey of one file
    one, again = images.training[7], images.training[7]
    assert one.shape == (3, 3, 8, 8) and torch.equal(one, again) and not torch.equal(one, images.training[8])
    pixels = one * std + mean
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5


def test_training_views_are_the_same_with_and_without_workers_and_leave_the_global_rng_alone():
    """A step's views depend on the seed and the step alone: made in this process, by two DataLoader
    workers (which make steps out of order and ahead of their use) or one at a time out of order,
    bit for bit the same; making them draws nothing from torch's global generator."""
    x = torch.rand(12, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    images = RecoveryImages([x], DATA_CONFIG, RecoveryConfig(seed=5, batch_size=4))  # 11 sources train
    made = {}
    for workers in (0, 2):
        with training_batches(images.training, 7, workers, pin_memory=False) as batches:
            made[workers] = list(batches)
    assert len(made[0]) == 7 and all(torch.equal(a, b) for a, b in zip(made[0], made[2]))
    torch.manual_seed(11)
    before = torch.random.get_rng_state()
    backwards = [images.training[step] for step in range(7, 0, -1)][::-1]
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(made[0], backwards))
    other = RecoveryImages([x], DATA_CONFIG, RecoveryConfig(seed=6, batch_size=4))
    assert not torch.equal(other.training[1], made[0][0])


def test_files_are_decoded_once_while_they_fit_and_the_views_are_those_decoded_each_time(tmp_path, monkeypatch):
    """Training files are decoded once and kept (uint8) up to DECODED_BYTES; beyond it each use
    decodes again. The views are the same either way, bit for bit."""
    from PIL import Image

    from corp_deploy.recovery import images as recovery_images

    paths = []
    for i in range(4):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(
            torch.randint(0, 256, (12, 16, 3), generator=torch.Generator().manual_seed(i)).byte().numpy()
        ).save(paths[-1])

    class Batches(list):
        image_sources = paths

    decoded = []
    load_rgb = recovery_images.load_rgb
    monkeypatch.setattr(recovery_images, "load_rgb", lambda path: decoded.append(path) or load_rgb(path))
    config = RecoveryConfig(validation=0.25, seed=3, batch_size=3)  # every step shows each of the 3 files
    views = {}
    for limit, decodes in ((recovery_images.DECODED_BYTES, 0), (2 * 3 * 12 * 16, 3)):  # keeps all 3 files, then 2
        monkeypatch.setattr(recovery_images, "DECODED_BYTES", limit)
        images = RecoveryImages(Batches([torch.zeros(4, 3, 8, 8)]), DATA_CONFIG, config)
        decoded.clear()
        views[limit] = [images.training[step] for step in (1, 2, 3)]
        assert len(decoded) == decodes  # with two kept, the third file is decoded at every step
    first, second = views.values()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_large_training_files_are_kept_shrunk_to_a_few_times_the_input(tmp_path):
    """A training file whose shorter side exceeds DECODED_SIDE times the model's input side is kept
    shrunk to that (its aspect kept); a smaller one as it is."""
    from PIL import Image

    from corp_deploy.recovery.images import DECODED_SIDE

    files = {tmp_path / "wide.png": (100, 50), tmp_path / "tall.png": (50, 120), tmp_path / "small.png": (20, 30)}
    for path, size in files.items():
        Image.new("RGB", size, (10, 20, 30)).save(path)
    side = DECODED_SIDE * 8  # the input is 8 px: kept at most 32 px on the shorter side
    shapes = {(3, side, 2 * side), (3, round(side * 120 / 50), side), (3, 30, 20)}

    class Batches(list):
        image_sources = list(files)

    images = RecoveryImages(Batches([torch.zeros(3, 3, 8, 8)]), DATA_CONFIG, RecoveryConfig(validation=0.34, seed=0))
    kept = images.training.sources
    assert len(kept) == 2 and all(image.dtype == torch.uint8 for image in kept)
    assert {tuple(image.shape) for image in kept} < shapes and any(min(i.shape[1:]) == side for i in kept)


def test_bare_tensors_are_their_own_sources_and_one_is_too_few():

    x = torch.arange(40.0).view(40, 1, 1, 1).expand(40, 3, 8, 8) / 40  # image i one flat value
    config = RecoveryConfig(validation=0.25, seed=3, color=0.0, mix=0.0, batch_size=30)
    images = RecoveryImages([x], DATA_CONFIG, config)
    assert images.sources == (30, 10) and images.validation.shape == (40, 3, 8, 8)  # 4 views of each

    def values(views):  # which image each view shows
        return {round(float(view[0].mean()) * 40) for view in views}

    held = values(images.validation)
    assert len(held) == 10 and values(images.training[1]) == set(range(40)) - held  # one step, one epoch
    with pytest.raises(CorpError, match="at least 2 distinct sources"):
        RecoveryImages([x[:1]], DATA_CONFIG, RecoveryConfig())
    assert RecoveryImages([x[:3]], DATA_CONFIG, RecoveryConfig(validation=0.5)).sources == (2, 1)  # half at most


def test_byte_identical_sources_are_one_source_on_one_side_of_the_split(tmp_path):
    """Copies of a file under other names, and repeated bare images, are counted once and held out
    or trained on whole: no image compression fits on (the training side) equals a held-out one."""
    from PIL import Image

    paths = []
    for i in range(12):  # 4 distinct greys, each in 3 files of other names
        paths.append(tmp_path / f"{i}.png")
        Image.new("RGB", (16, 12), (60 * (i % 4),) * 3).save(paths[-1])

    class Batches(list):
        image_sources = paths

    x = torch.arange(12.0).remainder(4).view(12, 1, 1, 1).expand(12, 3, 8, 8).contiguous() / 4  # image i: i mod 4
    for batches in (Batches([x]), [x[:5], x[5:]]):
        for seed in range(5):
            images = RecoveryImages(batches, DATA_CONFIG, RecoveryConfig(validation=0.5, seed=seed, batch_size=4))
            assert images.duplicates == 8 and images.sources == (2, 2)  # 4 distinct sources, counted once
            fit = torch.cat(images.fit_batches())
            assert len(fit) == 6  # the 3 copies of each of the 2 training sources
            held = [image for image in x if not any(torch.equal(image, seen) for seen in fit)]
            assert len(held) == 6  # every copy of the 2 held-out sources, none beside a copy in training
    with pytest.raises(CorpError, match=r"at least 2 distinct sources .*; got 1 and 2 byte-identical copies"):
        RecoveryImages([x[:1].expand(3, 3, 8, 8)], DATA_CONFIG, RecoveryConfig())


@pytest.mark.parametrize(
    "batch, message",
    [
        ((torch.rand(4, 3, 8, 8) * 255).to(torch.uint8), "must be preprocessed .*floating-point.* got torch.uint8"),
        (torch.full((4, 3, 8, 8), float("nan")), "NaN or infinite"),
        (torch.zeros(3, 8, 8), r"image tensors of shape \(B, 3, H, W\)"),
        (torch.zeros(4, 1, 8, 8), r"images of the model's input shape \(3, 8, 8\); got \(1, 8, 8\)"),
        (torch.zeros(4, 3, 16, 16), r"images of the model's input shape \(3, 8, 8\); got \(3, 16, 16\)"),
    ],
)
def test_recovery_refuses_the_batches_compress_refuses(batch, message):
    """Raw uint8 pixels (not preprocessed), NaN, a batch that is not (B, 3, H, W) or not of the
    model's input shape (one channel was broadcast to three): refused as compress refuses them,
    before any training (it trained on them before, or blamed the learning rate)."""
    with pytest.raises(CorpError, match=message):
        RecoveryImages([batch], DATA_CONFIG, RecoveryConfig())


def test_only_the_blocks_and_the_final_norm_learn(small_vit):
    """The final norm only where the final features are in the loss (``final_weight > 0``)."""
    names = set(trainable_parameters(small_vit()))
    assert all(name.startswith(("blocks.", "norm.")) for name in names)
    assert "norm.weight" in names and "blocks.1.mlp.fc2.bias" in names
    assert set(trainable_parameters(small_vit(), final_norm=False)) == {n for n in names if n.startswith("blocks.")}
    vectors = trainable_parameters(small_vit(), "vectors")
    assert set(vectors) < names and all(p.dim() == 1 for p in vectors.values())
    assert {"norm.weight", "blocks.0.norm1.bias", "blocks.1.mlp.fc1.bias", "blocks.1.attn.proj.bias"} <= set(vectors)
    assert {name for name in names - set(vectors) if not name.endswith(".weight")} == set()


def test_every_trained_parameter_is_in_the_loss_also_for_a_pooled_model(small_vit):
    """A pooled model's ``fc_norm`` acts after the pooling, outside ``forward_features`` and the
    loss: it does not train (an unused trained parameter also fails DistributedDataParallel's step)."""
    pooled = small_vit(global_pool="avg", fc_norm=True)
    assert isinstance(pooled.fc_norm, torch.nn.LayerNorm) and isinstance(pooled.norm, torch.nn.Identity)
    trained = trainable_parameters(pooled)
    x = torch.randn(2, 3, *pooled.patch_embed.img_size, generator=torch.Generator().manual_seed(0))
    pooled.forward_features(x).sum().backward()
    assert trained and all(p.grad is not None for p in trained.values())
    assert not any(name.startswith("fc_norm.") for name in trained)


def test_the_pooled_output_term_trains_the_blocks_through_a_frozen_fc_norm(small_vit, images):
    """``pooled_weight``: the loss has the pooled outputs' distance (here alone, the blocks' term
    cancelled by a student equal to the teacher but for one block); ``fc_norm`` passes the gradient
    and keeps its weights."""
    teacher = small_vit(global_pool="avg", fc_norm=True)
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.blocks[1].mlp.fc2.weight.mul_(0.5)
    x, twin = torch.cat(list(images))[:8], copy.deepcopy(student)
    run = _Distillation(student, teacher, RecoveryConfig(steps=1, pooled_weight=3.0, lr=1e-3))
    before = copy.deepcopy(student.state_dict())
    with torch.no_grad():
        s, t = (
            student.forward_head(student.forward_features(x), pre_logits=True),
            teacher.forward_head(teacher.forward_features(x), pre_logits=True),
        )
    pooled = float((1 - torch.nn.functional.cosine_similarity(s, t, dim=1)).mean())
    loss = run.step(x, 0)
    assert loss > 3.0 * pooled > 0  # the blocks' term (block 1 and after differ) and the pooled one
    after = student.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("fc_norm."))
    assert not torch.equal(after["blocks.1.mlp.fc2.weight"], before["blocks.1.mlp.fc2.weight"])
    no_pooled = _Distillation(twin, teacher, RecoveryConfig(steps=1, lr=1e-3))
    assert no_pooled.step(x, 0) == pytest.approx(loss - 3.0 * pooled, rel=1e-4)


@pytest.mark.parametrize("gain, kept", [(1e-7, 0), (1e-3, 1)])
def test_a_gain_within_float_rounding_is_not_kept(small_vit, images, monkeypatch, gain, kept):
    """A nearly exact compression "gained" 2e-8 by float rounding and had its weights replaced: a
    step is kept only for a validation gain above MIN_GAIN, 1e-5 (the measurements given here: the plain
    views' cosine at steps 0, 1, 2, 3; the distorted views' never falls)."""
    plain = iter([0.99, 0.99 + gain, 0.5, 0.5])
    calls = iter(range(100))
    monkeypatch.setattr(Validation, "validate", lambda self, ref: next(plain) if next(calls) % 2 == 0 else 0.9)
    dense = small_vit()
    report = recover(copy.deepcopy(dense), dense, images, RecoveryConfig(steps=3, batch_size=8, eval_every=1))
    assert report["best_step"] == kept


def test_training_the_vectors_changes_only_them_with_their_own_defaults(small_vit, images):
    """``train="vectors"``: the matrices keep compression's values; the learning rate defaults to
    the vectors' own (``TRAINED``) unless given."""
    assert (RecoveryConfig(train="vectors").lr, RecoveryConfig(train="vectors").blend) == (5e-4, 1.0)
    assert (RecoveryConfig().lr, RecoveryConfig().blend) == (2e-5, 1.0)
    assert RecoveryConfig(train="vectors", lr=1e-3, blend=0.25).to_settings()["recover_lr"] == 1e-3
    start, _ = compressed(small_vit(), images, compensation=False)
    model = copy.deepcopy(start)
    config = RecoveryConfig(steps=10, train="vectors", lr=3e-2, batch_size=8, eval_every=10, patience=10)
    assert recover(model, small_vit(), images, config)["best_step"] == 10
    vectors = trainable_parameters(start, "vectors", final_norm=False)  # the default loss: blocks only
    changed = {name for name, tensor in start.state_dict().items() if not torch.equal(model.state_dict()[name], tensor)}
    assert changed <= set(vectors) and len(changed) > 0.9 * len(vectors)


@pytest.mark.parametrize(
    "settings, name",
    [
        (dict(recover_steps=-1), "recover_steps"),
        (dict(recover_lr=0.0), "recover_lr"),
        (dict(recover_train="biases"), "recover_train"),
        (dict(recover_lr=float("nan")), "recover_lr"),
        (dict(recover_validation=1.5), "recover_validation"),
        (dict(recover_batch_size=0), "recover_batch_size"),
        (dict(recover_crop_scale=0.0), "recover_crop_scale"),
    ],
)
def test_bad_recovery_settings_name_their_setting(settings, name):
    with pytest.raises(SettingError) as raised:
        CompressConfig.from_settings(**settings)
    assert raised.value.settings == (name,)


def test_recovery_settings_without_recovery_steps_are_refused(tiny_artifact, tmp_path):
    """They would do nothing and not be recorded (the seed is compression's: not counted); a recovery
    of an artifact needs at least one step (0 would write compression again, not recovered)."""
    from corp_deploy import recover_artifact

    with pytest.raises(SettingError, match="recover_patience, recover_blend apply only with recover_steps N > 0") as e:
        CompressConfig.from_settings(sparsity=0.5, recover_blend=0.7, recover_patience=2)
    assert e.value.settings == ("recover_patience", "recover_blend", "recover_steps")
    assert CompressConfig.from_settings(recover_seed=3).recovery.seed == 3
    with pytest.raises(SettingError, match="recover_steps must be at least 1 to recover an artifact"):
        recover_artifact(tiny_artifact, RecoveryConfig(steps=0), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_recovery_settings_are_recorded_only_when_it_runs():
    config = CompressConfig.from_settings(recover_steps=50, recover_lr=1e-4)
    flat = config.to_dict()
    assert flat["recover_steps"] == 50 and flat["recover_lr"] == 1e-4
    assert CompressConfig.from_dict(flat) == config and "recover_steps" not in CompressConfig().to_dict()


def test_recover_works_on_an_already_compressed_model(small_vit, images):
    student, _ = compressed(small_vit(), images, compensation=False)
    flags = [p.requires_grad for p in student.parameters()]
    report = recover(student, small_vit(), images, QUICK)
    assert report["validation_cosine"]["recovered"] > report["validation_cosine"]["compressed"]
    assert [p.requires_grad for p in student.parameters()] == flags and not student.training


def test_compress_and_recover_commands_write_recovered_artifacts_that_export(other_tiny_artifact, tmp_path, run_cli):
    """``compress --recover-steps`` and ``recover ARTIFACT`` write artifacts of the compressed
    structure, recording the recovery; ``recover`` compresses the artifact's dense model again as
    compress did, with its seed (1 here) for the recovery too, so the two give the same weights;
    export takes them as any other; a recovered artifact is not recovered again."""
    from safetensors.torch import load_file

    from corp_deploy.artifact import read_config, read_report
    from tests.helpers import SMALL_VIT_CLI_ARGS

    quick = ["--recover-steps", 3, "--recover-batch-size", 2, "--recover-eval-every", 1]
    state = tmp_path / "state"
    result, text = run_cli(
        [
            "compress",
            "deit_tiny",
            "--no-pretrained",
            *SMALL_VIT_CLI_ARGS,
            "--calib-samples",
            16,
            "--s",
            0.5,
            "--seed",
            1,
            *quick,
            "-o",
            tmp_path / "c",
        ],
        state,
    )
    assert result.exit_code == 0, text
    result, text = run_cli(["recover", other_tiny_artifact, *quick, "-o", tmp_path / "r"], state)
    assert result.exit_code == 0, text
    assert "validation output cosine" in text
    # not on a terminal (a CI log): one line per validation measurement instead of a bar
    assert "recovering: step 1/3, loss " in text and "recovering: step 3/3, loss " in text
    for out in (tmp_path / "c", tmp_path / "r"):
        config, report = read_config(out), read_report(out)
        assert config.settings["recover_steps"] == 3 and 1 <= report["recovery"]["steps_run"] <= 3
        assert config.settings["recover_seed"] == 1 and report["recovery"]["settings"]["seed"] == 1
        assert config.blocks == read_config(other_tiny_artifact).blocks
    recovered, replayed = (load_file(tmp_path / out / "model.safetensors") for out in ("c", "r"))
    assert recovered.keys() == replayed.keys() and all(torch.equal(recovered[k], replayed[k]) for k in recovered)
    # the latest, the one recover wrote: recovered anew from its compression, as the first time
    result, text = run_cli(["recover", *quick, "-o", tmp_path / "again"], state)
    assert result.exit_code == 0, text
    assert f"recovering the most recent artifact: {tmp_path / 'r'}" in text
    assert "was recovered already (3 steps): recover starts again from its compression" in " ".join(text.split())
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == recovered.keys() and all(torch.equal(again[k], recovered[k]) for k in again)
    result, text = run_cli(["recover", other_tiny_artifact, "--recover-steps", 0, "-o", tmp_path / "none"], state)
    assert result.exit_code == 2 and "'--recover-steps': 0 is not in the range 1<=x<=1000000" in text
    assert "[default: 100;" in run_cli(["recover", "--help"], state)[1]  # what it does with no --recover-steps
    result, text = run_cli(["export", tmp_path / "r", "-o", tmp_path / "x"], state)
    assert result.exit_code == 0, text


def test_recover_refuses_an_artifact_whose_weights_are_damaged(tiny_artifact_copy, tmp_path, run_cli):
    """recover does not read the artifact's weights (it compresses again), but it checks them against
    the record like every command: a damaged artifact is refused, nothing written."""
    weights = tiny_artifact_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result, text = run_cli(["recover", tiny_artifact_copy, "-o", tmp_path / "rec"], tmp_path / "state")
    assert result.exit_code == 1 and "does not match" in text and "Traceback" not in text, text
    assert not (tmp_path / "rec").exists()


WORKERS_RUNNER = """
import os, signal, sys
import corp_deploy.recovery.images as images
import corp_deploy.recovery.training as training

def children(pid):  # the child processes of pid as "pid:start time" (the start time tells a
    # worker apart from a later process given its pid)
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(f"{entry}:{fields[19]}")
    return found

loss, init, calls, (written, sent) = training.distillation_loss, images._ignore_interrupts, [0], sys.argv[1:3]
def at_the_second_loss(*args, **kwargs):  # the named point: both workers have made a batch (step 2's)
    calls[0] += 1
    if calls[0] == 2:
        with open(written, "w") as out:
            out.write(" ".join(children(os.getpid())))
        if sent == "group":
            os.killpg(0, signal.SIGINT)  # as Ctrl-C in a terminal: every process of the group
        elif sent == "main":
            os.kill(os.getpid(), signal.SIGTERM)  # as kill PID: the main process alone
    return loss(*args, **kwargs)
def starting(worker):  # the named point: a worker started, before it ignores the interrupts
    if sent == "starting-worker":
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C while the workers start: the worker alone
    return init(worker)
training.distillation_loss, images._ignore_interrupts = at_the_second_loss, starting
sys.argv = ["corp-deploy", *sys.argv[3:]]
from corp_deploy.launch import main
main()
"""


@pytest.mark.slow  # a real subprocess with DataLoader workers, interrupted
@pytest.mark.parametrize("sent, code", [("group", 130), ("main", 143), ("starting-worker", 0)])
def test_an_interrupt_with_view_workers_running_leaves_no_output_and_no_worker(tmp_path, sent, code):
    """Ctrl-C (SIGINT to the whole process group, the workers included) or SIGTERM to the main
    process alone while two workers make training views: the run stops with its status and one
    message, writes nothing, and its workers are gone when it has exited. A worker that a signal
    reaches while it starts, before it ignores the interrupts (Ctrl-C as the workers start), leaves
    it to the main process (which it did not reach here): no traceback, and the run completes."""
    import os
    import subprocess
    import sys

    from helpers import AS_A_FOREGROUND_JOB, SMALL_VIT_CLI_ARGS

    args = ["compress", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--calib-samples", "8"]
    args += ["--recover-steps", "4", "--recover-batch-size", "2", "--recover-workers", "2", "-o", "art"]
    done = subprocess.run(
        [sys.executable, "-c", AS_A_FOREGROUND_JOB + WORKERS_RUNNER, str(tmp_path / "workers"), sent, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path), "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
        start_new_session=True,  # its own process group, so that "group" does not reach pytest
        timeout=600,
    )
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    workers = dict(entry.split(":") for entry in (tmp_path / "workers").read_text().split())
    assert len(workers) == 2  # the point was reached with both workers running
    assert not list(tmp_path.glob(".*tmp-*"))
    if code:
        signal_name = "SIGINT" if sent == "group" else "SIGTERM"
        assert f"stopped by {signal_name}" in done.stderr and not (tmp_path / "art").exists(), done.stderr
    else:
        assert (tmp_path / "art" / "model.safetensors").exists()
    # The run joins its workers before it exits (a daemon worker left over is joined at the latest by
    # multiprocessing at exit), so none of them is there once it has exited: no waiting needed.
    for pid, started in workers.items():
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as stat:
                assert stat.read().rsplit(")", 1)[1].split()[19] != started, "a view worker outlived the run"
