"""Peak resident memory of one `compress` run, phase by phase (random weights, built-in calibration
images): where the peak of budget mode is, for issue 24's goal (DeiT-B, 256 images, at most 3 GB).

    python -m lab.studies.phase_memory --model deit_base_patch16_224 --images 256 --macs 0.6 \\
        --in-place --out lab/results/phase_memory_deit_base.json

A thread reads the process's resident memory (``VmRSS``, Linux) every 20 ms and charges it to the
engine phase running at that moment (the phases of the compress report's ``time_s``, tracked by
wrapping the engine's phase timer; ``outside phases`` is the time between them). ``--in-place`` compresses
the model itself, as the CLI does; without it the library keeps the caller's model and compresses a copy.
Run it in a fresh process per point: the peak is the process's own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import threading
import time
from collections import defaultdict
from pathlib import Path

from corp_deploy import CalibrationImages, CompressConfig, compress, create_base_model, engine, model_transform
from corp_deploy.documents import library_versions


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


class PhaseSampler:
    """Peak resident MiB per engine phase, sampled every ``interval`` seconds by a thread."""

    def __init__(self, interval: float = 0.02) -> None:
        self.phases = ["outside phases"]
        self.peaks: dict[str, float] = defaultdict(float)
        self._interval, self._running = interval, True
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while self._running:
            phase = self.phases[-1]
            self.peaks[phase] = max(self.peaks[phase], resident_mib())
            time.sleep(self._interval)

    @contextlib.contextmanager
    def tracking(self):
        """Within: every phase the engine's timer opens is the one samples are charged to."""
        timed = engine._PhaseTimer.__call__

        @contextlib.contextmanager
        def call(timer, phase):
            self.phases.append(phase)
            try:
                with timed(timer, phase):
                    yield
            finally:
                self.phases.pop()

        engine._PhaseTimer.__call__ = call
        self._thread.start()
        try:
            yield self
        finally:
            self._running = False
            self._thread.join()
            engine._PhaseTimer.__call__ = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_base_patch16_224")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--macs", type=float, default=None, help="a MAC budget (default: uniform --s)")
    parser.add_argument("--s", type=float, default=0.5)
    parser.add_argument("--in-place", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = create_base_model(args.model, {}, pretrained=False, seed=0)
    transform, _ = model_transform(model)
    images = CalibrationImages.from_builtin(transform, count=args.images, batch_size=32)
    config = (
        CompressConfig.from_settings(macs=args.macs)
        if args.macs is not None
        else CompressConfig.from_settings(s_mlp=args.s, s_attn=args.s)
    )
    before = resident_mib()
    start = time.perf_counter()
    with PhaseSampler().tracking() as sampler:
        _, report = compress(model, images, config, in_place=args.in_place)
    result = {
        "command": f"python -m lab.studies.phase_memory --model {args.model} --images {args.images} "
        + (f"--macs {args.macs}" if args.macs is not None else f"--s {args.s}")
        + (" --in-place" if args.in_place else "")
        + f" --out {args.out}",
        "versions": library_versions(),
        "resident_before_compress_mib": round(before),
        "peak_resident_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "peak_by_phase_mib": {phase: round(peak) for phase, peak in sampler.peaks.items()},
        "compress_s": round(time.perf_counter() - start, 1),
        "time_s": report["time_s"],
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
