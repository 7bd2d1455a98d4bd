"""The ``torch-compile`` backend: a PyTorch module compiled by ``torch.compile`` with inductor, on
the CPU (C++ kernels, built with the machine's C++ compiler) or on CUDA (Triton kernels).

A :class:`CompiledTorchRunner` is a :class:`~exporters.runners.TorchRunner` (the same precisions,
the same host and device-resident calls) whose forward is the compiled one. It compiles on
construction, once per input shape it is given (static shapes: a batch size is a compile of its
own), records each compile's seconds apart from any timing, and refuses to compile again
afterwards, so that a timed call never hides a compile or falls back to eager PyTorch.
"""

from __future__ import annotations

import shutil
import time

import torch

from corp_deploy.errors import first_line

from .runners import BackendUnavailable, TorchRunner

#: How many compiles one code object may hold here (torch's default is 8, which two models at a few
#: batch sizes reach): every shape of every model compiled is one.
RECOMPILE_LIMIT = 64


def inductor_unavailable(device: str) -> str | None:
    """Why inductor cannot compile for ``device`` (``cpu``, ``cuda``) here, or None: torch.compile
    not supported by this Python, no C++ compiler for the CPU's kernels (the ones inductor
    searches: ``$CXX``, else g++), no Triton for CUDA's."""
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python with torch {torch.__version__}"
    if device == "cuda":
        from torch.utils._triton import has_triton  # torch's own probe, loaded only to compile for CUDA

        return None if has_triton() else "inductor needs Triton for CUDA kernels; this torch has none"
    from torch._inductor import config  # loaded only to compile

    wanted = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    names = [name for name in wanted if name]
    if not any(shutil.which(name) for name in names):
        return (
            f"inductor needs a C++ compiler for the CPU's kernels ({' or '.join(names) or 'none configured'} "
            "not found; install g++ or set CXX)"
        )
    return None


class CompiledTorchRunner(TorchRunner):
    """``model`` compiled by inductor on ``device`` in ``precision`` for each input shape of
    ``shapes`` (B, 3, H, W); ``compile_s``: seconds the first call at each batch size took (the
    compile), by batch size. With ``cuda_graphs`` (CUDA only) inductor's ``reduce-overhead`` mode
    replays its kernels as CUDA graphs. BackendUnavailable where inductor cannot run, with the
    reason (:func:`inductor_unavailable`, or the compile's own error)."""

    name = "torch-compile"

    def _prepare(self, shapes: tuple[tuple[int, ...], ...], cuda_graphs: bool) -> None:
        missing = inductor_unavailable(self.device.type)
        if missing:
            raise BackendUnavailable(missing)
        mode = "reduce-overhead" if cuda_graphs else None
        self.compiled = torch.compile(self.model, backend="inductor", mode=mode, dynamic=False)
        self.compile_s = {shape[0]: self._compile(shape) for shape in shapes}

    @torch.no_grad()
    def _compile(self, shape: tuple[int, ...]) -> float:
        x = torch.zeros(shape, device=self.device, dtype=self.dtype)
        start = time.perf_counter()
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
                self.compiled(x)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        except Exception as exc:  # inductor raises many kinds (BackendCompilerFailed, InvalidCxxCompiler, ...)
            reason = first_line(exc)
            raise BackendUnavailable(f"torch.compile (inductor) failed at batch {shape[0]}: {reason}") from None
        return time.perf_counter() - start

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        with torch.compiler.set_stance("fail_on_recompile"):  # a shape not compiled is an error, never eager
            return self.compiled(x)

    def _release(self) -> None:
        del self.compiled
        super()._release()
