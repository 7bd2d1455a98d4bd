"""Refusing up front what cannot fit: a lower bound on the memory (or temporary disk) a run
needs, against what the machine has available.

The bounds are deliberately low (what is certainly held at once, not what the allocators add),
so a run is refused only when it could not possibly fit; anything they let through can still run
out of memory, which the CLI reports as one message.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .cost import forward_blank_image
from .errors import CorpError
from .families import attention_macs, blocks_of, standard_copy
from .layers import head_dims

FLOAT32 = 4


def available_bytes() -> int | None:
    """Memory available to new allocations (Linux ``MemAvailable``; elsewhere the free physical
    pages), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def resident_bytes() -> int | None:
    """This process's resident memory (Linux ``VmRSS``), or None where it cannot be read."""
    return _status_bytes("VmRSS")


def resident_peak(run: Callable[[], object]) -> int | None:
    """The most resident memory this process held while ``run()`` ran: its peak (Linux ``VmHWM``,
    reset to the resident set first by writing ``5`` to ``/proc/self/clear_refs``), or, where the
    peak cannot be reset, the resident set once ``run`` returned (what an allocator that keeps what
    it allocated, as ONNX Runtime's arena does, still holds); None where neither can be read (not
    Linux), ``run`` then not called."""
    if resident_bytes() is None:
        return None
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        reset = True
    except OSError:
        reset = False
    run()
    after = resident_bytes() or 0
    peak = _status_bytes("VmHWM") if reset else None
    return max(after, peak or 0)


def _status_bytes(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or None where it cannot be read."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_freed_memory() -> bool:
    """Hand the memory freed since the last call back to the operating system: glibc keeps freed
    blocks below 32 MB (every weight tensor of an ONNX graph's protobuf, and ONNX Runtime's and
    PyTorch's buffers of that size) in its heap for reuse, where a later allocation often cannot
    reuse them, so a process that loads, rewrites and frees several graphs holds each one's
    memory long after it dropped them. Measured on ``export --dense --precision int8`` of DeiT-B
    (4 float32 graphs of 347 MB quantized in turn): peak RSS 4.0 GB without, 2.9 GB with a call
    after each graph step. ``malloc_trim(0)`` after a garbage collection; False (nothing done)
    where the C library is not glibc."""
    gc.collect()
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library this process runs on (its own symbols), or None where it cannot be opened."""
    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):
        return None


def largest_activation_bytes(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """Bytes (float32) of the largest output of any module of ``model`` for one image of
    ``input_size`` ``(C, H, W)``, measured on one forward pass of a blank image."""
    largest = 0

    def record(module, args, output):
        nonlocal largest
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor):
                largest = max(largest, tensor.numel() * FLOAT32)

    forward_blank_image(model, input_size, lambda module: record)
    return largest


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


#: The most images one inference may take: the range of the batch axis of the exported graphs (and
#: of bench's batch sizes); a batch this large is beyond the memory of any machine for a ViT.
MAX_BATCH = 1 << 16


def inference_bytes(model: nn.Module, input_size: tuple[int, ...], batch: int) -> int:
    """A lower bound on the memory one inference at ``batch`` adds to the loaded model: the input
    batch, and the largest activation together with the one it is computed from."""
    image = FLOAT32 * math.prod(input_size)
    return batch * (image + 2 * largest_activation_bytes(model, input_size))


def onnxruntime_bytes(model: nn.Module, input_size: tuple[int, ...], batch: int, element: int = FLOAT32) -> int:
    """A lower bound on the memory an ONNX Runtime CPU session of ``model``'s exported graph holds
    once it has run at ``batch``, beyond its weights and its input (activations of ``element``
    bytes): its arena keeps what a run allocated (it never shrinks by default), so every session a
    command has run holds this at once.

    Per image, one run holds at least the larger of what two steps hold at once: an op that maps the
    largest activation to another of its size (the MLP's GELU: its input and its output), and the
    softmax of the attention that computes the most scores (``heads x queries x keys``: ``tokens^2 x
    heads`` for a ViT's, ``x windows`` for Swin's; ONNX Runtime materialises them, its softmax writes
    in place) beside the residual stream the block adds back.

    Measured with ONNX Runtime 1.31's CPU provider (the resident memory a child process added by
    running one session, arena and memory pattern on, as bench runs them), float32 DeiT-shaped ViTs of
    17 to 257 tokens (3-12 heads, width 48-192, 2-6 blocks) at batches 16-16384: the session held
    1.3-4.2x this bound after its first run and 1.5-7.7x from its second on (its memory pattern then
    adds a block of its own), the least where the scores dominate (257 tokens, 12 heads), the most
    where the MLP does; per image within 5% at every batch and depth tried. The small ViT of the
    tests (32 px, patch 8, width 48): 100 KB after one run and 183 KB after two, bound 26 KB; its
    compressed form (s = 0.5) 53 KB and 97 KB, bound 13 KB. The surplus is ONNX Runtime's planner
    and allocators (buffers it keeps for later layers), which no formula here predicts: bench measures
    it once its sessions are open (:func:`benchmarks.harness.check_onnxruntime_timing`)."""
    one_image = max(2 * largest_activation_bytes(model, input_size) // FLOAT32, _largest_attention(model, input_size))
    return batch * element * one_image


def _largest_attention(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """The most elements any one attention of ``model`` holds at its softmax for one image of
    ``input_size``: its scores (its family's MAC formula over the MACs per score,
    :func:`~corp_deploy.families.attention_macs`) and the residual stream of its size beside them."""
    largest = 0

    def hook_of(module):
        formula = attention_macs(module)
        if formula is None:
            return None

        def record(module, args, output):
            nonlocal largest
            scores = formula(module, tuple(args[0].shape)) // max(1, sum(head_dims(module)))
            largest = max(largest, scores + args[0].numel())

        return record

    forward_blank_image(standard_copy(model), input_size, hook_of)
    return largest


def training_bytes(model: nn.Module, input_size: tuple[int, ...], batch: int) -> int:
    """A lower bound on the memory one training step (recovery) of ``model``, or of a model compressed
    from it, adds at ``batch``: the input batch, and in every block the normed residual streams that
    the query/key/value and first MLP layers read, which autograd keeps for their weights' gradients
    (two of the block's output size; pruning never narrows them)."""
    blocks = set(map(id, blocks_of(model)))
    kept = 0

    def record(module, args, output):
        nonlocal kept
        kept += 2 * output.numel() * FLOAT32

    forward_blank_image(model, input_size, lambda module: record if id(module) in blocks else None)
    return batch * (FLOAT32 * math.prod(input_size) + kept)


def check_fits(what: str, needed: int, hint: str) -> None:
    """CorpError when ``needed`` bytes (a lower bound) exceed the memory available now."""
    available = available_bytes()
    if available is not None and needed > available:
        raise CorpError(
            f"{what} needs at least {needed / 2**30:.1f} GiB of memory (estimated) and "
            f"{available / 2**30:.1f} GiB are available; {hint}"
        )


def check_disk(what: str, needed: int, folder: str | Path, hint: str) -> None:
    """CorpError when ``needed`` bytes exceed the free space of the file system of ``folder``."""
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise CorpError(
            f"{what} needs {size_in_words(needed)} of disk in {folder} and {size_in_words(free)} are free; {hint}"
        )


def size_in_words(count: int) -> str:
    """A number of bytes in words: ``1.2 GiB``, ``340 MiB``, ``12 KiB``, ``100 bytes``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} bytes"
