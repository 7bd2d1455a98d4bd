"""Data-parallel calibration on torch.distributed (``torchrun``): every statistic CORP needs is a
sum over calibration images, so each process (rank) accumulates it over its own share of the
images and the ranks sum it with one all-reduce (gloo on the CPU, NCCL on CUDA: the same code).

Every rank is given the same calibration batches and runs its share through the model (the engine
deals batch ``b`` to rank ``b mod world size``). Without an initialised process group every function
here is the single-process identity.
"""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from .interrupts import INTERRUPTS


def active() -> bool:
    """Whether a torch.distributed process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def launched_by_torchrun() -> bool:
    """Whether this process is one of several that ``torchrun`` started (its environment says so)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_environment(device: str, timeout: timedelta | None = None) -> None:
    """Join the process group ``torchrun`` set up (gloo for a CPU ``device``, NCCL for CUDA; CUDA
    ranks take the GPU of their local rank). ``timeout``: how long a collective waits for the other
    ranks (torch's default, 10 to 30 minutes, when None). No-op when not launched by torchrun or
    already joined."""
    if not launched_by_torchrun() or dist.is_initialized():
        return
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    with _signals_end_the_process():
        dist.init_process_group("nccl" if cuda else "gloo", **({"timeout": timeout} if timeout else {}))


@contextlib.contextmanager
def _signals_end_the_process():
    """The interrupts (:data:`corp_deploy.interrupts.INTERRUPTS`) end the process at once (their
    default action) inside the block. Joining the group waits for the other ranks in one C++ call,
    in which Python's own handlers (:mod:`corp_deploy.launch`) would run only once it returns: when
    another rank died before joining, torchrun's SIGTERM went unanswered for its 30 s grace period
    and the process was then killed. Nothing is being written while a process joins."""
    previous = {
        signum: signal.signal(signum, signal.SIG_DFL)
        for signum in INTERRUPTS
        if signal.getsignal(signum) != signal.SIG_IGN  # ignored from the start (nohup's SIGHUP): left so
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def shutdown() -> None:
    """Leave the process group (no-op when none is running)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` says that another process of the group went away (it failed or was killed:
    its own message, not this one, tells why)."""
    network = getattr(dist, "DistNetworkError", ())
    return launched_by_torchrun() and (
        isinstance(exc, network) or "closed by peer" in str(exc) or "reset by peer" in str(exc)
    )


def barrier() -> None:
    """Wait until every rank is here (no-op in one process)."""
    if active():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the ranks, in place (returned for chaining)."""
    if active():
        dist.all_reduce(tensor)
    return tensor


def sum_floats(*values: float) -> list[float]:
    """Python numbers summed over the ranks (float64)."""
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=_device())).tolist()


def gather_counts(count: int) -> list[int]:
    """Every rank's ``count``, in rank order."""
    counts = torch.zeros(world_size(), dtype=torch.float64, device=_device())
    counts[rank()] = count
    return [int(c) for c in all_reduce_sum(counts).tolist()]


def all_gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The ranks' ``tensor`` ``(n_rank, ...)`` concatenated along dim 0 in rank order (``n_rank`` may
    differ between ranks; the other dims may not)."""
    if not active():
        return tensor
    counts = gather_counts(tensor.shape[0])
    padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def _device() -> torch.device:
    """Where small messages live: the CPU for gloo, this rank's GPU for NCCL."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
