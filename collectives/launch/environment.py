"""Who am I? Reading rank, world size and local rank from whatever launched us.

Every launcher tells its processes their place in the job through environment
variables, each launcher with its own names:

    launcher        rank                  world size            local rank
    torchrun        RANK                  WORLD_SIZE            LOCAL_RANK
    MPICH / Hydra   PMI_RANK              PMI_SIZE              MPI_LOCALRANKID
    Open MPI        OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_RANK
    MVAPICH         MV2_COMM_WORLD_RANK   MV2_COMM_WORLD_SIZE   MV2_COMM_WORLD_LOCAL_RANK
    PMIx            PMIX_RANK             (MPI, or SLURM_NTASKS) (0)
    Slurm (srun)    SLURM_PROCID          SLURM_NTASKS          SLURM_LOCALID

They are checked in that order: an explicit torchrun setting wins, and an MPI
launcher's variables win over Slurm's, because `mpirun` inside a Slurm allocation
inherits the batch script's SLURM_PROCID=0. With none of them set we are a single
process: rank 0 of a world of 1.

Slurm's variables name a rank only inside a job step, a process `srun` started (it sets
SLURM_STEP_ID). A batch script or an `salloc` shell also sees SLURM_PROCID=0 and
SLURM_NTASKS, the whole allocation's task count: `python train.py` run there directly,
without srun, is one process, not rank 0 of a world that will never come. Ranks on a
node under srun: SLURM_STEP_TASKS_PER_NODE ("2(x3),1": tasks on each of the step's
nodes), at this node's place, SLURM_NODEID (SLURM_NTASKS_PER_NODE is the allocation's,
not the step's). An MPI launched by srun (`srun --mpi=pmi2`) names the rank but not
the local rank: SLURM_LOCALID gives it.

`detect_launch()` only reads the environment; it never starts communication, so it
is cheap to call and easy to test with a faked environment.

One launcher also speaks through the command line: `python -m torch.distributed.launch`
(deprecated, but still in torch and in the tutorials) appends `--local-rank=N` to every
rank's arguments, before the script's own (older torch versions spelled it
`--local_rank`). A script whose parser does not know the flag exits with "unrecognized
arguments". `add_local_rank_argument(parser)` teaches a parser both spellings.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import List, Mapping, MutableMapping, Optional, Sequence, Tuple


class LaunchError(RuntimeError):
    """A launch setting is missing or inconsistent. The message is one line naming it."""


def _print_launch_errors_as_one_line(previous_hook):
    """An uncaught LaunchError prints one line, not a traceback on every rank."""
    def hook(kind, error, trace):
        if issubclass(kind, LaunchError):
            print(f"collectives: error: {error}", file=sys.stderr)
        else:
            previous_hook(kind, error, trace)
    return hook


sys.excepthook = _print_launch_errors_as_one_line(sys.excepthook)


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun", "mpich", "openmpi", "mvapich", "pmix", "slurm" or "none"
    local_world_size: Optional[int] = None  # ranks on this host, when the launcher says
    # mpirun's: one rank that dies ends them all (see _ends_every_rank_when_one_dies)
    ends_every_rank_when_one_dies: bool = False

    @property
    def is_mpi_launcher(self) -> bool:
        """True when an MPI process manager started us, so MPI can carry the rendezvous."""
        return self.launcher in ("mpich", "openmpi", "mvapich", "pmix")


# (launcher, rank variable, size variable, local rank variable, local size variable)
_LAUNCHERS = [
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
     "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("pmix", "PMIX_RANK", None, None, None),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
]


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    """True in a process srun started; False in a batch script or an salloc shell."""
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def _slurm_tasks_on_this_node(env: Mapping[str, str]) -> Optional[int]:
    """Tasks of this job step on this node: SLURM_STEP_TASKS_PER_NODE ("2(x3),1") at
    the place SLURM_NODEID names; None when Slurm does not say."""
    counts: List[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        count, _, times = part.partition("(x")
        try:
            counts += [int(count)] * int(times.rstrip(")") or 1)
        except ValueError:
            return None
    try:
        return counts[int(env["SLURM_NODEID"])]
    except (KeyError, ValueError, IndexError):
        return None


def _ends_every_rank_when_one_dies(launcher: str, env: Mapping[str, str]) -> bool:
    """Whether what started this process ends every rank of the job when one dies.

    mpirun (mpiexec) does, of every MPI: MPICH's Hydra, Open MPI's, MVAPICH's. An MPI
    job is one unit, so that a rank lost ends it instead of leaving the others blocked
    in a collective; a job that must outlive a rank (--elastic) cannot run under it.
    The others leave the ranks alone: srun (unless told to, --kill-on-bad-exit), ranks
    started one by one, and torchrun beyond its own host (its agent stops the workers
    it started, so one torchrun per host is the unit that can be lost).

    The variables that name the rank do not always name who started it: an MPI's under
    srun (`srun --mpi=pmi2` sets PMI_RANK) came from srun. Hydra marks the ranks its
    proxies start (HYDI_CONTROL_FD), even where mpirun starts the proxies through srun
    inside an allocation; Open MPI's mpirun sets OMPI_COMM_WORLD_* itself (under srun
    only PMIx's variables are there at start)."""
    if launcher == "openmpi":
        return True
    if launcher in ("mpich", "mvapich", "pmix"):
        return "HYDI_CONTROL_FD" in env or not _in_slurm_step(env)
    return False


def split_command(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """A launcher's own options and the command after "--": ("-np 4 -- python x" ->
    (["-np", "4"], ["python", "x"])). Without "--" there is no command."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _read_int(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer") from None
    if value < 0:
        raise LaunchError(f"{name}={value} is negative")
    return value


def _optional_int(env: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    if name is None or name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        return None


def detect_launch(env: Optional[Mapping[str, str]] = None,
                  mpi_world_size: Optional[int] = None) -> LaunchInfo:
    """Read this process's rank, world size and local rank from the launcher's variables.

    `mpi_world_size` is used only for PMIx, which names the rank but not the size.
    Raises LaunchError, naming the variable, when the settings are inconsistent.
    """
    env = os.environ if env is None else env
    for launcher, rank_var, size_var, local_var, local_size_var in _LAUNCHERS:
        if launcher == "slurm" and not _in_slurm_step(env):
            continue  # a batch script's or salloc's variables: the allocation's, not ours
        has_rank = rank_var in env
        has_size = size_var is not None and size_var in env
        if not has_rank and not has_size:
            continue
        if not has_rank:
            raise LaunchError(f"{size_var} is set but {rank_var} is not: set both or neither")
        rank = _read_int(env, rank_var)
        if size_var is None:  # PMIx gives no size variable: ask MPI, else other launchers
            size = mpi_world_size
            if size is None and "SLURM_NTASKS" in env:  # srun --mpi=pmix
                size = _read_int(env, "SLURM_NTASKS")
            if size is None:
                raise LaunchError(f"{rank_var} is set but no world size is known: "
                                  "install mpi4py or set WORLD_SIZE")
            size_var = "the world size"
        elif not has_size:
            raise LaunchError(f"{rank_var} is set but {size_var} is not: set both or neither")
        else:
            size = _read_int(env, size_var)
        if size < 1:
            raise LaunchError(f"{size_var}={size} must be at least 1")
        if rank >= size:
            raise LaunchError(f"{rank_var}={rank} must be below {size_var}={size}")
        local_rank = _read_int(env, local_var) if local_var and local_var in env else None
        local_size = _optional_int(env, local_size_var)
        if _in_slurm_step(env):  # srun started us: Slurm knows this node's tasks
            if local_rank is None and "SLURM_LOCALID" in env:
                local_rank = _read_int(env, "SLURM_LOCALID")
            if local_size is None:
                local_size = _slurm_tasks_on_this_node(env)
        return LaunchInfo(rank, size, local_rank or 0, launcher, local_size,
                          _ends_every_rank_when_one_dies(launcher, env))
    return LaunchInfo(0, 1, 0, "none", 1)


def _local_rank_value(text: str) -> int:
    """argparse type of --local-rank: an integer, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a local rank (0 or more), got {text!r}") \
            from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


class _LocalRankAction(argparse.Action):
    """Stores --local-rank's value and exports it as LOCAL_RANK, unless that is already set.

    Exporting it is what lets the flag count: `detect_launch()`, `collectives.init()` and
    the torch backend read the local rank from LOCAL_RANK, not from a parser's result.
    """

    def __init__(self, option_strings, dest, environ=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.environ = environ

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        environ = os.environ if self.environ is None else self.environ
        environ.setdefault("LOCAL_RANK", str(value))  # the launcher's variable wins


def add_local_rank_argument(parser, environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Accept the local rank that `torch.distributed.launch` passes on the command line.

    Adds `--local-rank N` and its older spelling `--local_rank N` (each also as
    `--local-rank=N`) to `parser` (an ArgumentParser or one of its argument groups); the
    value lands in `args.local_rank` (None when the flag is absent). When the flag is
    given and the environment has no LOCAL_RANK, the value is exported as LOCAL_RANK, so
    that everything which reads the launch from the environment sees it.

    When LOCAL_RANK is already set, it wins and the flag changes nothing. torch's own
    launcher sets both: in torch 2.14, `torch.distributed.launch` is `torch.distributed.run`
    (torchrun) without its `--use-env`, so every rank gets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT in its environment *and* `--local-rank=N` on its command
    line. The flag is the only source of the local rank for a launcher that passes
    nothing else.

    `environ` (default: os.environ) is where LOCAL_RANK is exported; tests pass a dict.
    """
    parser.add_argument("--local-rank", type=_local_rank_value, metavar="N",
                        action=_LocalRankAction, environ=environ,
                        help="this process's local rank, as torch.distributed.launch passes "
                             "it; $LOCAL_RANK wins when set")
    parser.add_argument("--local_rank", dest="local_rank", type=_local_rank_value,
                        action=_LocalRankAction, environ=environ,
                        help=argparse.SUPPRESS)  # the pre-2.0 spelling, accepted unlisted
