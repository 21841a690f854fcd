"""Process-group set-up for DeepSpeed, the same for one CPU process and many GPU nodes."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from pipeline.errors import PipelineError

# Ranks other than 0 wait in a collective while rank 0 downloads and preprocesses (minutes to
# an hour for the large corpora); the default 30-minute collective timeout would kill them.
TIMEOUT_VARIABLE = "ALLATTN_DIST_TIMEOUT_MIN"
DEFAULT_TIMEOUT_MIN = 180


def collective_timeout() -> timedelta:
    """How long a rank waits in a collective: $ALLATTN_DIST_TIMEOUT_MIN minutes (default 180),
    read when a group starts; a value that is no whole number of minutes is one line."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip() or str(DEFAULT_TIMEOUT_MIN)
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= 10**6:
        from pipeline.errors import shown

        raise PipelineError(
            f"environment variable {TIMEOUT_VARIABLE} {shown(text)}: not a whole number of "
            f"minutes from 1 to 1000000 (how long the other ranks wait while rank 0 downloads "
            f"and preprocesses; default {DEFAULT_TIMEOUT_MIN})"
        )
    return timedelta(minutes=int(text))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a launcher (or prepare_environment, for a single process) exports to describe the
# process group a process belongs to.
GROUP_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
)


def drop_inherited_group() -> dict[str, str]:
    """Make this process, a command of its own (not a rank a launcher started), a group of
    one: the process-group variables it inherited (a torchrun step's, a Kubernetes training
    pod's RANK, WORLD_SIZE, MASTER_*) describe another launch, which it would wait to join
    for hours (or fail on its busy MASTER_PORT). They are taken out of the environment and
    returned; `prepare_environment` then gives the process a group of its own on a free
    port. Once this process's own group is started, the variables are its own and stay."""
    if _group_started:
        return {}
    return {name: os.environ.pop(name) for name in GROUP_VARIABLES if name in os.environ}


def environment_for_new_group() -> dict[str, str]:
    """This process's environment less its process-group variables: for a child that is a run
    of its own. A child inheriting them would rendezvous at this process's MASTER_PORT (two
    such children at once: "address already in use")."""
    return {k: v for k, v in os.environ.items() if k not in GROUP_VARIABLES}


def take_rank_from_slurm() -> None:
    """This process is one task of an `srun` step (the Slurm batch script's): its rank and
    the world come from Slurm's task variables. MASTER_ADDR / MASTER_PORT the script exports."""
    slurm = {
        "RANK": "SLURM_PROCID",
        "LOCAL_RANK": "SLURM_LOCALID",
        "WORLD_SIZE": "SLURM_NTASKS",
        "LOCAL_WORLD_SIZE": "SLURM_NTASKS_PER_NODE",
    }
    missing = [v for v in (*slurm.values(), "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise PipelineError(
            f"--ranks-from-slurm: {', '.join(missing)} not set; this process "
            f"is not a task of an srun step started by the Slurm script"
        )
    os.environ.update({ours: os.environ[theirs] for ours, theirs in slurm.items()})


def prepare_environment() -> None:
    """Environment DeepSpeed reads at import time. Call before `import deepspeed`."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # C++ ops DeepSpeed builds on first use: cached per interpreter prefix (virtualenv),
    # so two environments never clobber each other's builds.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    _pin_ninja()
    # Launched by hand as a single process: give the process group what a launcher would.
    if "RANK" not in os.environ:
        os.environ.update(
            {
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": os.environ.get("MASTER_PORT", str(free_port())),
            }
        )


def init_process_group() -> tuple[int, int]:
    """(rank, world size), the group initialised with nccl on CUDA and gloo on CPU."""
    prepare_environment()
    try:
        import deepspeed
    except ValueError as e:  # DeepSpeed picks its accelerator when imported
        if "DS_ACCELERATOR" not in str(e):
            raise
        from pipeline.errors import shown

        raise PipelineError(
            f"environment variable DS_ACCELERATOR {shown(os.environ.get('DS_ACCELERATOR', ''))}: "
            f"{shown(str(e))}; unset it to let DeepSpeed choose"
        ) from None
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        timeout = collective_timeout()
        alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
        if not alone:
            _load_comm_op()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            # our own group, bound to the local rank's GPU; DeepSpeed adopts an initialised one
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            dist.init_process_group(
                backend,
                timeout=timeout,
                **nccl_group_kwargs(int(os.environ.get("WORLD_SIZE", "1")), local_rank),
            )
        with _without_comm_op() if alone else nullcontext():
            deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
        _unlink_shm_buffer(dist.get_rank())
        atexit.register(_destroy_process_group)
        global _group_started
        _group_started = True
    return dist.get_rank(), dist.get_world_size()


def nccl_group_kwargs(world_size: int, local_rank: int) -> dict:
    """What `init_process_group` gets for an NCCL group besides the backend and timeout:
    `device_id`, the local rank's GPU, whenever there are other ranks. Bound, NCCL connects
    the group at once on that GPU, and collectives without tensors (barrier) use it instead of
    "Guessing device ID based on global rank" (a hang where ranks do not map to GPUs in
    order). A group of one is left unbound, as DeepSpeed does since 0.19 (deepspeedai/
    DeepSpeed#8248, #8269): bound, every later new_group() is split from it with
    ncclCommSplit, which failed with CUDA error 600 on single GPUs; such a process has set
    its current device, which is the one it uses."""
    import torch

    if world_size <= 1:
        return {}
    return {"device_id": torch.device("cuda", local_rank)}


_group_started = False


def _destroy_process_group() -> None:
    """At exit, while the interpreter is still whole: a gloo group left for finalization
    holds tensors in its worker threads when Python is torn down. Not earlier: in one process
    DeepSpeed caches the group in module globals, so it must live as long as we do."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code=0) -> NoReturn:
    """End a program's main process with `code` (SystemExit's meaning: None, an int, or a
    message for stderr and 1). Once a process group was started, Python's exit handlers run
    (the group is destroyed, logs flushed) and then the process ends without the C++ static
    destructors: with the group destroyed, they still abort a run that succeeded now and then
    ("terminate called without an active exception", exit -6, no Python frame left), which a
    launcher reports as a failed rank."""
    if not isinstance(code, int | None):
        print(code, file=sys.stderr)
        code = 1
    if not _group_started:
        sys.exit(code)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or its reader went away
                pass
        os._exit(code or 0)


def _pin_ninja() -> None:
    """torch builds C++ ops with the first `ninja` on PATH. The image's ninja (1.11) and the
    virtualenv's (the pip package DeepSpeed requires, 1.13) each read the other's .ninja_log as
    too old or as different commands, and rebuild the whole op: an activated virtualenv or not
    decided which one ran. The environment's own ninja first on PATH makes every entry point
    (and every rank a launcher starts, which inherits PATH) build with it, once."""
    from ninja import BIN_DIR

    path = os.environ.get("PATH", "")
    if BIN_DIR and path.split(os.pathsep)[0] != BIN_DIR:
        os.environ["PATH"] = os.pathsep.join([BIN_DIR, path])


# In TORCH_EXTENSIONS_DIR: held (flock) by whichever process builds or loads an op there.
OP_BUILD_LOCK = "allattn-op-build.lock"


# Ranks started together take turns loading a built op in a fraction of a second: only a
# longer wait (a build) is worth a line on the terminal.
QUIET_WAIT_S = 3.0


@contextmanager
def _op_build_lock(extensions: Path):
    """Exclusive hold of `extensions` for one process. A flock, so the kernel releases it when
    its holder dies, however it dies (torch's own `lock` file stays behind a killed build);
    where the file system has no flock, a lock file (pipeline.locks)."""
    extensions.mkdir(parents=True, exist_ok=True)
    from pipeline.fsutil import open_for_write
    from pipeline.locks import stale_hint, wait_lock

    path = extensions / OP_BUILD_LOCK

    def notice() -> None:
        hint = stale_hint(path, "build")
        print(
            f"waiting for another process building DeepSpeed's C++ ops in {extensions}"
            + (f"; {hint}" if hint else ""),
            file=sys.stderr,
            flush=True,
        )

    with open_for_write(path, "op build lock file", append=True) as f:
        timer = threading.Timer(QUIET_WAIT_S, notice)
        timer.start()
        try:
            held = wait_lock(f.fileno(), path, f"DeepSpeed's op builds in {extensions}")
        finally:
            timer.cancel()
        assert held is not None  # no deadline: it returns once the lock is held
        try:
            yield
        finally:
            held.release()


@contextmanager
def _without_comm_op():
    """deepspeed.init_distributed with no shared-memory comm op: DeepSpeed builds it on CPU
    (a C++ build of ~4 minutes the first time) for every group, but uses it only in
    `inference_all_reduce` between several ranks, which returns its tensor untouched in a
    group of one: a single process trains the same without it. Where DeepSpeed has no
    `build_shm_op` to stand in for, the op is built as for several ranks."""
    import importlib

    # by its full name: `import deepspeed.comm.torch as m` gives torch itself, which
    # deepspeed.comm's namespace holds under that name
    ds_torch: Any = importlib.import_module("deepspeed.comm.torch")
    if not hasattr(ds_torch, "build_shm_op"):
        _load_comm_op()
        yield
        return
    build = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = build


def _load_comm_op() -> None:
    """Build (or load) the shared-memory comm op that deepspeed.init_distributed loads on CPU,
    the same op on the same condition, but under OP_BUILD_LOCK; init_distributed then finds
    it loaded. While we hold the lock no other process is building, so a torch `lock` file in
    the op's build directory is what a killed build left: torch would wait on it forever.
    A build takes minutes and prints nothing until it is done: said before it starts."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    extensions = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    with _op_build_lock(extensions):
        if not (extensions / builder.name / f"{builder.name}.so").exists():
            print(
                f"building DeepSpeed's CPU communication op {builder.name} in {extensions} "
                f"(once per virtualenv, ~4 min)",
                file=sys.stderr,
                flush=True,
            )
        stale = extensions / builder.name / "lock"
        if stale.exists():
            print(
                f"removing {stale}: an interrupted build of DeepSpeed's {builder.name} op "
                f"left it (no process is building it now)",
                file=sys.stderr,
                flush=True,
            )
            stale.unlink(missing_ok=True)
        builder.load()


def _unlink_shm_buffer(rank: int) -> None:
    """On CPU, DeepSpeed's shared-memory all-reduce creates a ~69 MB file per rank in /dev/shm
    and never removes it: every run leaked one until reboot. Once every rank has mapped
    the others' files (they have when init returns; the barrier makes sure of all of them),
    the names can go; the mappings live until the processes exit."""
    barrier()
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
        f"{os.environ.get('MASTER_PORT')}_{rank}"
    )
    Path("/dev/shm", name).unlink(missing_ok=True)


def launched() -> bool:
    """True inside a multi-process launch (deepspeed, torchrun, srun set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _several() -> bool:
    """True when there are other ranks to talk to."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


# how gloo's transport reports a peer that is gone (pair.cc): its socket closed or reset
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective of this rank failing because another rank left the
    group (it failed, printed its own error and exited): a torch DistError (NCCL), or gloo's
    RuntimeError naming the closed connection. Such a rank's traceback says nothing of why."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _PEER_GONE)


def stopped_line(rank: int, world_size: int) -> str:
    """What a rank prints instead of its traceback when another rank failed first."""
    other = f"rank {1 - rank}" if world_size == 2 else "another rank"
    return f"rank {rank}: stopped because {other} failed"


def broadcast_object(obj=None, src: int = 0):
    """`obj` from rank `src` on every rank (a no-op in one process)."""
    import torch.distributed as dist

    if not _several():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


_host_group: tuple[object, object] | None = None
"""(the default group it was made for, a gloo group over the same ranks)."""


def _group_for_host_values():
    """The group for the few host values the loop shares every step (the stop flag, the
    logged loss): under NCCL each would be copied to the GPU and read back, a host sync that
    waits for every kernel queued before it. A gloo group over the same ranks adds them on the
    CPU instead. None: the default group is already on the CPU."""
    import torch.distributed as dist

    global _host_group
    if dist.get_backend() != "nccl":
        return None
    if _host_group is None or _host_group[0] is not dist.group.WORLD:
        # collective: every rank gets here at its first shared value, at the same point
        _host_group = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _host_group[1]


def _all_reduce(value: float, op) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=_group_for_host_values())
    return t.item()


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (a one-element all_reduce)."""
    import torch.distributed as dist

    return bool(_all_reduce(float(flag), dist.ReduceOp.MAX)) if _several() else flag


def min_over_ranks(value: float) -> float:
    import torch.distributed as dist

    return _all_reduce(value, dist.ReduceOp.MIN) if _several() else value


def mean_over_ranks(value: float) -> float:
    import torch.distributed as dist

    if not _several():
        return value
    return _all_reduce(value, dist.ReduceOp.SUM) / dist.get_world_size()


def barrier() -> None:
    import torch.distributed as dist

    if _several():
        dist.barrier()
