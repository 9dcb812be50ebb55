"""The trainer's command line. `python -m trainer --help` prints this as its manual."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, Iterable, NoReturn, Tuple

from collectives import algorithms, sync
from collectives.launch import add_local_rank_argument
from .. import torch_peers
from . import progress
from ..tasks import IMAGE_DATASETS, MODELS, TEXT_DATASETS, images, kind_of, language, optimizers
from ..tasks.gpt import SIZES as GPT_SIZES
from ..tasks.resnets import ARCHITECTURES

DESCRIPTION = """\
Data-parallel training with communication from `collectives`: a torchvision ResNet on
images, or a byte-level GPT on text.

With no flags it trains ResNet-18 on an embedded dataset (10 classes of drawn shapes,
generated in memory, no files needed) and shows the loss falling and the accuracy
rising. --model gpt-tiny trains a language model on this Python's standard library
sources (no download), scored by held-out bits per byte. It runs the same way under
every launcher, or as one plain process:

  mpirun -np 4 python -m trainer
  mpirun -np 4 python -m trainer --model gpt-tiny --optimizer adamw --sync diloco:period=30
  ./launch_mpi.sh -np 4 -- python -m trainer --dataset mnist --data-dir ../shared/data
  torchrun --nproc-per-node 4 -m trainer --epochs 1
  python -m torch.distributed.launch --nproc-per-node 4 --module trainer --epochs 1
  python -m trainer --epochs 1                       # one process, no launcher
"""

EPILOG = """\
Every epoch (a language model's: every --eval-every steps), rank 0 prints one line:
train loss, test accuracy or held-out bits per byte, images or tokens/s (all ranks
together), the share of time the communication threads were busy, the share the
training thread waited on communication, and the MiB this rank sent per step (on the
emulated cluster: its host's NIC, divided by the ranks on that host).
--metrics FILE appends the same as JSON lines; --checkpoint-dir keeps a checkpoint of
the latest epoch (written atomically) that --resume continues from exactly.
"""


def fail(message: str) -> NoReturn:
    """End the run with argparse's kind of error: one line, exit code 2."""
    print(f"trainer: error: {message}", file=sys.stderr)
    sys.exit(2)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def bucket_size(text: str):
    """--bucket-mb: "auto" or megabytes above 0."""
    if text == "auto":
        return text
    try:
        return positive_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"use megabytes above 0 or auto, got {text}") from None


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def step_range(text: str):
    """'2:4' -> (2, 4); '3' -> (3, 3)."""
    first, _, last = text.partition(":")
    try:
        first, last = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST step numbers, got {text!r}")
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"need 1 <= FIRST <= LAST, got {text!r}")
    return first, last


def sync_option(text: str) -> Tuple[str, str]:
    """--sync-option 'period=8' -> ('period', '8'). The value stays text: the strategy
    that takes it converts it to the type it declares (collectives/sync/options.py)."""
    try:
        return sync.options.split_option(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


SYNC_NAMES = sync.available() + torch_peers.NAMES


def parse_sync(spec: str, sync_options: Iterable[Tuple[str, Any]] = ()
               ) -> Tuple[str, Dict[str, Any]]:
    """--sync NAME[:KEY=VALUE...] and the --sync-option pairs -> (name, options), each
    option converted to the type the strategy (or torch peer) declares for it: the one
    reading of a strategy's spelling that the trainer, trainer.bench and
    trainer.compare share. A bad name or option raises ValueError or TypeError, with the
    line to print."""
    name, given = sync.options.split(spec)
    flags: Dict[str, Any] = {}
    for key, value in sync_options:  # a repeated flag is refused, as a repeated key is
        if key in flags:
            raise ValueError(f"{name}: {key} is given twice as --sync-option")
        flags[key] = value
    options = sync.options.merged(name, given, flags)
    if torch_peers.is_peer(name):  # torch's peers declare the options they take as ours do
        return name, sync.options.typed(name, peer_class(name).__init__, options)
    if name not in sync.available():
        raise ValueError(f"argument --sync: invalid choice: {name!r} (choose from "
                         f"{', '.join(map(repr, SYNC_NAMES))})")
    return sync.parse(name, **options)


def peer_class(name: str):
    """The class of torch's peer `name` (torchft's imported only when asked for)."""
    if name == "torchft-diloco":
        from ..torchft_peer import TorchftDiLoCo
        return TorchftDiLoCo
    return torch_peers.TorchPeer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model and data (the task follows from --model)")
    model.add_argument("--model", "--arch", dest="arch", default="resnet18", choices=MODELS,
                       metavar="MODEL",
                       help="a torchvision ResNet (image classification; the stem adapted "
                            f"to small images): {', '.join(ARCHITECTURES)}; or a byte-level "
                            f"GPT (language modelling): {', '.join(GPT_SIZES)} "
                            "(default: resnet18)")
    model.add_argument("--dataset", choices=IMAGE_DATASETS + TEXT_DATASETS,
                       help="images: shapes (embedded, no files; the default), mnist, "
                            "cifar10 (torchvision's, under --data-dir), imagefolder "
                            "(--data-dir/train and --data-dir/val). Text: stdlib (this "
                            "Python's standard library sources; the default), text (every "
                            "file under --data-dir)")
    model.add_argument("--data-dir", help="folder holding the dataset (nothing is downloaded)")
    model.add_argument("--train-samples", type=positive_int,
                       help="images: use only the first N training images (default: all; "
                            "shapes: 2048)")
    model.add_argument("--test-samples", type=positive_int,
                       help="use only the first N test images (default: all; shapes: 512); "
                            "text: score N held-out windows (default: 256)")
    model.add_argument("--workers", type=non_negative_int, default=0,
                       help="DataLoader worker processes per rank (default: 0)")
    model.add_argument("--shards", default="auto", choices=["auto", "static", "dynamic"],
                       help="how each epoch is dealt to the ranks. static: equal shards "
                            "(torch's DistributedSampler; text: disjoint random windows); "
                            "dynamic: one step's images at a "
                            "time to whichever rank asks, so a faster rank trains more of "
                            "the epoch (only strategies whose ranks may take different "
                            "numbers of steps: async-avg; images only); auto (default): "
                            "dynamic where the strategy allows it and there is more than "
                            "one rank, else static")

    optim = p.add_argument_group("optimisation (defaults: the task's; a GPT's after the /)")
    optim.add_argument("--epochs", type=positive_int,
                       help="images: epochs (default: 3)")
    optim.add_argument("--steps", type=positive_int,
                       help="language models: optimizer steps (default: 1000)")
    optim.add_argument("--eval-every", type=positive_int, metavar="STEPS",
                       help="language models: steps between held-out evaluations "
                            "(default: 100)")
    optim.add_argument("--batch-size", type=positive_int,
                       help="samples per rank per step: images, or windows of the model's "
                            "context (default: 32 / 16)")
    optim.add_argument("--optimizer", choices=optimizers.NAMES,
                       help="sgd (with --momentum), adamw (betas 0.9, 0.95), or muon (Muon "
                            "on hidden matrices, AdamW on the rest) (default: sgd / adamw)")
    optim.add_argument("--lr", type=positive_float,
                       help="peak learning rate (default: 0.05 / 3e-3)")
    optim.add_argument("--momentum", type=non_negative_float, default=0.9,
                       help="SGD momentum (default: 0.9)")
    optim.add_argument("--weight-decay", type=non_negative_float,
                       help="weight decay (default: 1e-4 / 0.1)")
    optim.add_argument("--schedule", default="cosine", choices=["cosine", "constant"],
                       help="learning rate after the warm-up: cosine decays to 0 over the "
                            "run (default: cosine)")
    optim.add_argument("--warmup-steps", type=non_negative_int,
                       help="linear warm-up of the learning rate (default: 0 / 5%% of "
                            "--steps)")
    optim.add_argument("--clip-grad", type=non_negative_float, metavar="NORM",
                       help="clip the gradients' total norm to NORM before each step, 0 "
                            "for none (default: 0 / 1.0)")
    optim.add_argument("--amp", default="off", choices=["off", "bf16", "fp16"],
                       help="mixed precision; fp16 uses a GradScaler (default: off)")
    optim.add_argument("--accum-steps", type=positive_int, default=1,
                       help="micro-batches per optimizer step, synchronised only on the last "
                            "(default: 1)")
    optim.add_argument("--stop-at", type=positive_float, metavar="SCORE",
                       help="end training after the first evaluation that reaches SCORE: a "
                            "test accuracy (images, e.g. 0.95) or held-out bits per byte "
                            "(text, e.g. 2.5); the schedule still spans the whole run")
    optim.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    optim.add_argument("--skip-nonfinite", action="store_true",
                       help="when any rank's gradients hold inf or NaN, skip that step on every "
                            "rank together (with a warning) instead of applying it")

    comm = p.add_argument_group("communication")
    comm.add_argument("--sync", default="allreduce", metavar="NAME[:KEY=VALUE...]",
                      help="sync strategy, its options after colons "
                           "(allreduce:overlap=forward, local-sgd:period=8): "
                           f"{', '.join(sync.available())} (default: allreduce, what DDP "
                           f"does); {', '.join(torch_peers.NAMES)} are torch's own DDP and "
                           "comm hooks, for comparison")
    comm.add_argument("--sync-option", action="append", default=[], metavar="KEY=VALUE",
                      type=sync_option,
                      help="an option for the sync strategy, repeatable, the same as one "
                           "after its name: e.g. period=8 warmup_steps=20 (local-sgd), "
                           "ratio=0.01 (topk), rank=2 (powersgd), nesterov=false (diloco)")
    comm.add_argument("--algorithm", default="ring", choices=algorithms.names("all_reduce"),
                      help="collective algorithm for each gradient bucket (default: ring, "
                           "built from send/recv here; native is the backend's own)")
    comm.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"],
                      help="auto: nccl where every host has a GPU for each of its ranks, "
                           "else gloo (default: auto)")
    comm.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                      help="where each rank trains. auto: a GPU where there is one (ranks "
                           "share it when there are fewer GPUs than ranks; communication "
                           "then goes through host memory), else the CPU (default: auto)")
    comm.add_argument("--shm", default=None, choices=["auto", "on", "off"],
                      help="point-to-point through shared memory between ranks of one host "
                           "(gloo, mpi; default: $COLLECTIVES_SHM, else auto = when possible)")
    comm.add_argument("--bucket-mb", type=bucket_size, default=None,
                      help="gradient bucket size cap in MiB (default: 25, as DDP), or "
                           "auto: ours sized for the link after two steps "
                           "(collectives/bucket_sizes.py; torch's DDP keeps its default)")
    comm.add_argument("--timeout", type=positive_float, default=300.0,
                      help="seconds to wait for a silent peer before failing (default: 300)")
    add_local_rank_argument(comm)  # torch.distributed.launch passes --local-rank=N

    elastic = p.add_argument_group("elastic (ranks may be lost and come; loop/elastic.py)")
    elastic.add_argument("--elastic", action="store_true",
                         help="go on when a rank is lost, on the ranks left, from the last "
                              "step every rank had; take in ranks that come (started the "
                              "same way) at the next step. Syncs: " + ", ".join(ELASTIC_SYNCS))
    elastic.add_argument("--store", metavar="HOST:PORT",
                         help="the membership store (`python -m collectives.elastic.store`), "
                              "on a host that outlives the ranks (default: "
                              "$COLLECTIVES_ELASTIC_STORE)")
    elastic.add_argument("--min-ranks", type=positive_int, default=1,
                         help="end the job (exit 1, one line) when fewer ranks than this are "
                              "left (default: 1)")

    files = p.add_argument_group("files")
    files.add_argument("--checkpoint-dir",
                       help="save checkpoint.pt here after every epoch (atomically)")
    files.add_argument("--resume", metavar="PATH", help="continue from this checkpoint")
    files.add_argument("--eval-only", action="store_true",
                       help="with --resume: evaluate the checkpoint on the test split and stop")
    files.add_argument("--metrics", metavar="FILE",
                       help="append one JSON object per epoch (evaluation) to FILE")
    files.add_argument("--tensorboard", metavar="DIR",
                       help="write TensorBoard event files to DIR (rank 0): the training "
                            "loss every step, the held-out figures at every evaluation, "
                            "against steps, and against MiB sent and seconds trained "
                            "(`tensorboard --logdir DIR`)")
    files.add_argument("--progress", choices=progress.MODES, default="auto",
                       help="rank 0's progress: a bar on a terminal, lines in a log file "
                            "(auto, the default: lines in a Slurm batch job or when stderr "
                            "is a file), bar, lines or off")
    files.add_argument("--trace", metavar="DIR",
                       help="write a timeline of --trace-steps: DIR/rank<R>.json per rank and "
                            "DIR/trace.json (all ranks, one clock) for Perfetto; "
                            "`python -m collectives.trace DIR` draws and summarises it")
    files.add_argument("--trace-steps", type=step_range, default=(2, 4), metavar="FIRST:LAST",
                       help="the optimizer steps to trace, counted from 1 (default: 2:4)")
    files.add_argument("--trace-level", type=int, choices=[1, 2], default=1,
                       help="1: steps, forward, backward, optimizer, waits, buckets "
                            "(default); 2: also each algorithm's steps")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.eval_only and not args.resume:
        parser.error("--eval-only needs --resume PATH (the checkpoint to evaluate)")
    fill_task_defaults(parser, args)
    if args.dataset not in ("shapes", "stdlib") and not args.data_dir:
        parser.error(f"--dataset {args.dataset} needs --data-dir (the folder holding it)")
    try:  # a strategy rejects unknown or bad options before anything runs
        # --sync local-sgd:period=8 and --sync local-sgd --sync-option period=8 are one
        # run: the name alone in args.sync, every option, typed, in args.sync_option
        # (what a checkpoint records and a resume compares)
        args.sync, args.sync_options = parse_sync(args.sync, args.sync_option)
        args.sync_option = sorted(args.sync_options.items())  # one order for --resume's check
        strategy = create_sync(args)
    except (TypeError, ValueError, RuntimeError) as error:  # RuntimeError: a missing extra
        parser.error(str(error))
    uneven = getattr(strategy, "uneven_steps", False)
    if args.shards == "dynamic" and not uneven:
        parser.error(f"--shards dynamic: --sync {args.sync} meets every rank in a collective "
                     "every step (or every period), so every rank must take the same "
                     "number of steps; use --shards static")
    if getattr(strategy, "overlap", "backward") == "forward":
        refuse_for_forward_overlap(parser, args)
    if getattr(strategy, "hands_over_the_update", False):
        refuse_but_plain_sgd(parser, args)
    if args.elastic:
        refuse_for_elastic(parser, args)
    elif args.store or args.min_ranks != 1:
        parser.error("--store and --min-ranks belong to --elastic")
    if torch_peers.is_peer(args.sync) and args.backend == "mpi":
        parser.error(f"--sync {args.sync} is torch's DDP: it runs on torch.distributed "
                     "(--backend gloo or nccl), not on --backend mpi")
    return args


def fill_task_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags of the task --model names, its defaults where one was not given; a flag
    of the other task is refused (argparse's error, exit 2)."""
    kind = kind_of(args.arch)
    if kind == "language":
        others = {"--epochs": args.epochs, "--train-samples": args.train_samples}
        datasets = TEXT_DATASETS
        language.fill_defaults(args)
        if args.shards == "dynamic":
            parser.error("--shards dynamic deals images; a language model's ranks draw "
                         "their windows at random: use --shards static")
        args.shards = "static"  # auto: windows drawn at random, the same count per rank
        if args.elastic:
            parser.error("--elastic trains the image models; not a language model yet")
    else:
        others = {"--steps": args.steps, "--eval-every": args.eval_every}
        datasets = IMAGE_DATASETS
        for key, value in {**images.DEFAULTS, "epochs": 3}.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    for flag, given in others.items():
        if given is not None:
            parser.error(f"{flag} does not apply to --model {args.arch} "
                         f"({'language modelling' if kind == 'language' else 'images'})")
    if args.dataset not in datasets:
        parser.error(f"--dataset {args.dataset} is not for --model {args.arch}: choose "
                     f"from {', '.join(datasets)}")
    if args.optimizer == "muon" and kind == "images":
        parser.error("--optimizer muon takes the hidden matrices of a transformer "
                     "(--model gpt-*); a ResNet's are convolutions")


# Strategies whose replicas are equal at known steps, so a lost rank's survivors can go
# back to one: gradient averaging every step, local-sgd at each averaging.
ELASTIC_SYNCS = ("allreduce", "fp16", "bf16", "local-sgd")


def refuse_for_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What --elastic cannot do yet, as argparse's error (exit 2)."""
    if args.sync not in ELASTIC_SYNCS:
        parser.error(f"--elastic --sync {args.sync}: its ranks keep state of their own (a "
                     "lost rank would take it along); use one of " + ", ".join(ELASTIC_SYNCS))
    unsupported = {"--amp fp16": args.amp == "fp16", "--accum-steps": args.accum_steps > 1,
                   "--shards dynamic": args.shards == "dynamic", "--trace": bool(args.trace),
                   "--backend mpi/nccl": args.backend in ("mpi", "nccl"),
                   "--eval-only": args.eval_only, "--skip-nonfinite": args.skip_nonfinite,
                   "--shm on": args.shm == "on", "--tensorboard": bool(args.tensorboard),
                   "--optimizer other than sgd": args.optimizer != "sgd",
                   "--warmup-steps": args.warmup_steps > 0, "--clip-grad": args.clip_grad > 0}
    for flag, given in unsupported.items():
        if given:
            parser.error(f"--elastic does not take {flag}")


def refuse_but_plain_sgd(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A strategy that hands over the whole update as the gradient (onebit-adam: Adam's
    m / sqrt(v)) needs an optimizer that applies it as it is (exit 2 otherwise)."""
    wrong = {f"--optimizer {args.optimizer}": args.optimizer != "sgd",
             f"--momentum {args.momentum}": args.optimizer == "sgd" and args.momentum != 0,
             f"--clip-grad {args.clip_grad}": args.clip_grad > 0}
    given = [flag for flag, is_wrong in wrong.items() if is_wrong]
    if given:
        parser.error(f"--sync {args.sync} computes the whole update itself: it needs "
                     f"--optimizer sgd --momentum 0 --clip-grad 0 (got {', '.join(given)})")


def refuse_for_forward_overlap(parser: argparse.ArgumentParser,
                               args: argparse.Namespace) -> None:
    """overlap=forward takes the optimizer step layer by layer inside the next forward:
    what needs every gradient at once, or a step taken at once, is refused (exit 2)."""
    unsupported = {"--amp fp16 (its inf check spans every gradient)": args.amp == "fp16",
                   "--skip-nonfinite (it asks about every gradient)": args.skip_nonfinite,
                   "--elastic (a commit would come before its step)": args.elastic,
                   "--bucket-mb auto": args.bucket_mb == "auto",
                   "--clip-grad (it needs every gradient at once)": args.clip_grad > 0,
                   "--optimizer muon (it steps a matrix from its whole momentum)":
                       args.optimizer == "muon"}
    for flag, given in unsupported.items():
        if given:
            parser.error(f"--sync {args.sync} with overlap=forward does not take {flag}")


def create_sync(args: argparse.Namespace):
    """The strategy --sync names: one of ours, or a torch peer (torch's DDP and hook)."""
    return build_sync(args.sync, args.sync_options, args.algorithm)


def build_sync(name: str, options: Dict[str, Any], algorithm: str = "auto"):
    """Strategy `name` (ours, or a torch peer) built with `options` as parse_sync gives
    them; ours all-reduce with `algorithm` unless the options name one. What only the
    strategy can check (a period of at least 1) raises here."""
    if torch_peers.is_peer(name):
        return torch_peers.create(name, **options)
    return sync.create(name, **{"algorithm": algorithm, **options})
