"""The dense model an artifact was compressed from, as ``config.json`` records it (``base_model``):
the timm name and creation arguments that rebuild its skeleton (:func:`base_model_spec`, checked by
:func:`check_base_model`), and where its weights came from (:func:`weights_record`: a checkpoint with
its SHA-256, a bundled wheel, timm's pretrained weights or a seeded random initialisation), from
which export --dense, bench and recover rebuild it (:func:`rebuilt_dense`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .bundled_weights import bundled_model
from .errors import BadUsage, CorpError
from .families import in_standard_form, standard_copy
from .files import sha256_file
from .models import base_skeleton, create_base_model, resolve_model_name, state_mismatch


def base_model_spec(
    model: nn.Module, name: str | None = None, model_kwargs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Name and creation kwargs that rebuild ``model``'s dense skeleton with timm.

    Without explicit values, the name comes from timm's ``pretrained_cfg`` and the kwargs
    from the model itself (``img_size``, ``num_classes``); :func:`save_artifact` checks
    that they really rebuild a matching skeleton.
    """
    if name is None:
        name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
        if name is None:
            raise CorpError("cannot tell which timm model this is; pass its timm name explicitly")
    if model_kwargs is None:
        img = model.patch_embed.img_size
        model_kwargs = {
            "img_size": list(img) if isinstance(img, (tuple, list)) else img,
            "num_classes": model.num_classes,
        }
    return {"name": name, "model_kwargs": dict(model_kwargs)}


def check_base_model(base_model: dict[str, Any], dense: nn.Module, *, inferred: bool) -> None:
    """CorpError unless ``base_model`` (:func:`base_model_spec`'s record; ``inferred`` when it was
    made from ``dense`` rather than given) rebuilds a model of ``dense``'s structure: the same
    tensors, each of the same shape. Checked on a skeleton without weights before compressing, so
    that a record :func:`save_artifact` would refuse is refused before the work."""
    check_base_model_form(base_model)
    name, kwargs = base_model["name"], base_model.get("model_kwargs")
    skeleton = base_skeleton(name, kwargs, standard=in_standard_form(dense)).state_dict()
    problem = state_mismatch(skeleton, dense.state_dict(), "the model given", f"timm's {name} with {kwargs}")
    if problem is None:
        return
    if inferred:
        raise CorpError(
            f"cannot tell how to rebuild this model: timm's {name} built with {kwargs} differs from it "
            f"({problem}); pass base_model={{'name': ..., 'model_kwargs': {{...}}}} with the arguments it "
            "was created with"
        )
    raise CorpError(f"base_model does not rebuild the model given ({problem}): give the arguments it was created with")


def check_base_model_form(base_model: Any) -> None:
    """BadUsage unless ``base_model`` is a dict of a ``name``, ``model_kwargs`` (a dict; optional)
    and ``weights`` (optional: :func:`complete_weights_record`), and nothing else."""
    unknown = sorted(set(base_model) - {"name", "model_kwargs", "weights"}) if isinstance(base_model, dict) else []
    if (
        not isinstance(base_model, dict)
        or unknown
        or not isinstance(base_model.get("name"), str)
        or not isinstance(base_model.get("model_kwargs", {}), dict)
    ):
        raise BadUsage(
            "base_model is a dict of 'name' (the timm model's), 'model_kwargs' (a dict) and 'weights'"
            + (f"; got the unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}" if unknown else "")
        )


def complete_base_model(base_model: dict[str, Any]) -> dict[str, Any]:
    """``base_model`` (of the form :func:`check_base_model_form` admits) as ``config.json`` records
    it: ``model_kwargs`` ({} when not given) and the weights record completed
    (:func:`complete_weights_record`; None without one)."""
    return {"model_kwargs": {}, **base_model, "weights": complete_weights_record(base_model)}


def weights_record(checkpoint: str | Path | None, pretrained: bool, seed: int, *, name: str) -> dict:
    """Where the weights of the dense model ``name`` (as :func:`~corp_deploy.models.resolve_model_name`
    returns it) came from, as ``config.json`` records it for :func:`load_base_model`: a checkpoint
    (path and SHA-256), a bundled model's wheel (package, version, file and SHA-256), timm's
    pretrained weights, or the seeded random initialisation."""
    if checkpoint is not None:
        return {"source": "checkpoint", "path": str(Path(checkpoint).resolve()), "sha256": sha256_file(checkpoint)}
    if not pretrained:
        return {"source": "random", "seed": seed}
    bundled = bundled_model(name)
    return bundled.record() if bundled is not None else {"source": "timm-pretrained"}


#: How a ``base_model`` record given to the library names the dense weights (README's forms).
WEIGHTS_FORMS = (
    "{'source': 'checkpoint', 'path': FILE}, {'source': 'random', 'seed': N} (create_base_model's seed, N >= 0) "
    "or {'source': 'pretrained'} (the bundled wheel's or timm's pretrained weights)"
)


def rebuilt_dense(name: str, kwargs: dict, weights: dict, origin: str) -> nn.Module:
    """The dense model ``name`` built with ``kwargs`` and the weights a complete weights record
    (:func:`weights_record`'s) names; ``origin`` (``the artifact X``) for messages."""
    source = weights.get("source")
    if source == "checkpoint":
        checkpoint = Path(weights["path"])
        if not checkpoint.is_file():
            raise CorpError(
                f"the dense weights of {origin} came from {checkpoint}, which no longer exists; put the file back "
                "there (its SHA-256 is recorded and checked), as the dense model is rebuilt from it"
            )
        if sha256_file(checkpoint) != weights.get("sha256"):
            raise CorpError(
                f"{checkpoint} has changed since {origin} was compressed (SHA-256 differs); put back the file it "
                "was compressed from, as the dense model is rebuilt from it"
            )
        return create_base_model(name, kwargs, pretrained=False, checkpoint=checkpoint)
    if source == "random":
        return create_base_model(name, kwargs, pretrained=False, seed=weights["seed"])
    bundled = bundled_model(name) if source == "bundled" else None
    if bundled is not None:
        bundled.check_record(weights, origin)
        return create_base_model(name, kwargs, pretrained=True)
    if source == "timm-pretrained":
        return create_base_model(name, kwargs, pretrained=True)
    raise CorpError(
        f"{origin} does not record where its dense weights came from"
        + ("" if source is None else f" (an unknown source, {source!r})")
        + ", so the "
        "dense model cannot be rebuilt for export --dense, bench or recover. An artifact written through the "
        "Python API from a model corp-deploy did not build records them only when told: compress it again "
        f"with base_model={{'name': ..., 'model_kwargs': ..., 'weights': ...}}, the weights {WEIGHTS_FORMS}"
    )


def complete_weights_record(base_model: dict[str, Any]) -> dict[str, Any] | None:
    """``base_model["weights"]`` (None where absent) in the form ``config.json`` records
    (:func:`weights_record`'s): a checkpoint's path resolved and its SHA-256 computed (a SHA-256
    given must be the file's), ``{'source': 'pretrained'}`` resolved to the bundled wheel or timm's
    weights. BadUsage for a record of another form, CorpError for a checkpoint that is not there."""
    weights = base_model.get("weights")
    if weights is None:
        return None
    source = weights.get("source") if isinstance(weights, dict) else None
    name = resolve_model_name(base_model["name"], base_model.get("model_kwargs"))
    known = {"source", "path", "sha256"}
    if source == "checkpoint" and isinstance(weights.get("path"), (str, os.PathLike)) and set(weights) <= known:
        if not Path(weights["path"]).is_file():
            raise CorpError(f"base_model's weights checkpoint {weights['path']} is not a file")
        record = weights_record(weights["path"], False, 0, name=name)
        if weights.get("sha256") not in (None, record["sha256"]):
            raise CorpError(f"{weights['path']} does not have the SHA-256 base_model's weights record gives")
        return record
    seed = weights.get("seed") if source == "random" else None
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 and set(weights) == {"source", "seed"}:
        return {"source": "random", "seed": seed}
    if source in ("pretrained", "timm-pretrained", "bundled"):
        record = weights_record(None, True, 0, name=name)
        if source == "bundled" and (record["source"] != "bundled" or weights.get("sha256") != record["sha256"]):
            raise CorpError(f"base_model's weights record names bundled weights that are not {name}'s installed ones")
        return record
    raise BadUsage(f"base_model's 'weights' is {WEIGHTS_FORMS}; got {weights!r}")


def check_dense_weights(base_model: dict[str, Any], dense: nn.Module) -> None:
    """CorpError unless the dense model ``base_model``'s complete weights record rebuilds holds
    exactly ``dense``'s weights (compared on the CPU, in standard form), so that export --dense,
    bench and recover later meet the model that was compressed. timm's pretrained weights are not
    rebuilt (that needs the hub): they are taken as given."""
    weights = base_model["weights"]
    if weights["source"] == "timm-pretrained":
        return
    rebuilt = rebuilt_dense(base_model["name"], base_model["model_kwargs"], weights, "base_model").state_dict()
    given = standard_copy(dense).state_dict()
    differs = next((k for k, v in rebuilt.items() if k not in given or not torch.equal(v, given[k].cpu())), None)
    if differs is not None:
        raise CorpError(
            f"base_model's weights record ({weights['source']}) does not rebuild the model given ({differs} "
            "differs): export --dense, bench and recover would compare with another model. Give the record "
            f"of the weights the model holds: {WEIGHTS_FORMS}, or none"
        )
