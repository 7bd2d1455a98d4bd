"""``corp-deploy recover``: the label-free recovery of an artifact compress wrote, into a new artifact."""

from __future__ import annotations

import click

from .common import DEFAULT_OUTPUT_ROOT, check_output_paths, input_dir, results_output, warn
from .group import cli
from .options import IMAGE_COUNT, PATH, recovery_options

#: Steps when ``recover`` is given none (compress's --recover-steps defaults to 0: off): on a 2-core CPU
#: about 8 minutes for DINOv2 ViT-S/14 (lab/RESULTS.md, "Recovery").
DEFAULT_STEPS = 100


@cli.command()
@click.argument("artifact", type=PATH, required=False)
@recovery_options(steps=DEFAULT_STEPS)
@click.option(
    "--calib",
    type=PATH,
    default=None,
    help="Directory of unlabelled images. [default: those the artifact was calibrated on]",
)
@click.option(
    "--calib-samples", type=IMAGE_COUNT, default=None, help="Number of images. [default: as many as compress used]"
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "-o",
    "--output",
    type=PATH,
    default=None,
    help="The recovered artifact. [default: ./corp-deploy/<artifact name>-rec<STEPS>]",
)
def recover(artifact, calib, calib_samples, device, output, **recovery_settings):
    """Distil a compressed artifact from the dense model it was compressed from, on unlabelled images.

    The same as `compress --recover-steps N` for an artifact compress already wrote (the latest
    one by default): its dense model is rebuilt from its record and compressed again with its
    settings, this time with the recovery (whose validation images compression must not fit on),
    into a new artifact; the artifact itself is left as it is (an artifact recovered already gets a
    new recovery from its compression, not more steps of its own). Export and bench work as before
    (uniform sparsities keep the artifact's dims; a budget's or VBP's are fitted again on the
    images compression sees, and can differ by a few channels). Recovery stops early when its
    validation images stop improving and never leaves the model worse there than compression did.

    \b
    Examples:
      corp-deploy recover                                   # the latest artifact
      corp-deploy recover corp-deploy/deit_small-s0.5 --recover-steps 500 -o out/deit-rec
    """
    from ..artifact import Artifact
    from ..calibration import CalibrationSpec
    from ..engine import resolve_device
    from ..latest import latest_artifact, record_latest
    from ..outputs import check_output_dir
    from ..recovery import RecoveryConfig, recovery_table
    from ..workflow import recover_artifact

    if artifact is None:
        artifact = latest_artifact()
        click.echo(f"recovering the most recent artifact: {artifact}", err=True)
    else:
        artifact = input_dir(artifact, "ARTIFACT")
    artifact = Artifact.read(artifact)  # read once: recover_artifact is given it
    config = artifact.config
    steps = config.settings.get("recover_steps")
    if steps:
        click.echo(
            f"{artifact} was recovered already ({steps} step{'s' if steps != 1 else ''}): recover starts again from "
            "its compression, so its recovery is replaced, not continued",
            err=True,
        )
    # the recovery's seed is the compression's, as compress --seed gives it to both
    seed = config.settings.get("seed", 0)
    recovery = RecoveryConfig.from_settings({**recovery_settings, "recover_seed": seed})
    out_dir = check_output_dir(output or DEFAULT_OUTPUT_ROOT / f"{artifact.path.name}-rec{recovery.steps}", "artifact")
    calib = input_dir(calib, "--calib")
    check_output_paths([out_dir], {"--calib": calib, "ARTIFACT": artifact}, records_state=True)
    resolve_device(device)
    calibration = None
    if calib is not None or calib_samples is not None:
        calibration = CalibrationSpec.recorded(config.calibration, config.settings, source=calib, samples=calib_samples)
    result = recover_artifact(
        artifact,
        recovery,
        out_dir,
        calibration=calibration,
        device=device,
        progress=True,  # a bar on a terminal; elsewhere one line per validation measurement
    )
    for message in result.calibration_warnings():
        warn(message)
    recorded = set(config.calibration.get("image_digests", []))
    used = set(result.calibration.get("image_digests", []))
    if calibration is None and recorded and used != recorded:  # its own images, changed since compress read them
        warn(
            f"the calibration folder holds other images than when {artifact} was compressed ({len(used & recorded)} "
            f"of the {len(recorded)} it recorded are there): the recovered artifact is not the one compress "
            "--recover-steps would have made"
        )
    warn(record_latest(result.path))
    with results_output() as console:
        console.print(recovery_table(result.report["recovery"], result.path))
