"""A strategy's options: every option of every registered strategy refuses a bad value
in one line that names the strategy, the option, the value and what it needs; and one
spelling, NAME:KEY=VALUE (or --sync-option), means the same strategy in the library,
DistributedDataParallel, the trainer, trainer.bench and trainer.compare."""
import re
from datetime import timedelta

import pytest
import torch

from collectives import DistributedDataParallel, sync
from collectives.sync.options import WORDS, declared
from collectives.transport.local import LocalTransport
from launchers import run, trainer as trainer_command
from trainer import bench, compare
from trainer.loop import cli

# Values of the right type that a strategy refuses, for every option that has a range or
# a set of values (an option not listed takes every value of its type: algorithm's are
# checked for every strategy below, seed takes any whole number). Each value may come
# with other options it is refused beside: a period that local_period does not divide.
OUT_OF_RANGE = {
    "allreduce": {"overlap": ["sideways"], "chunk_mb": [0.0, -1.5, "big"]},
    "fp16": {"overlap": ["sideways"], "chunk_mb": [0.0]},
    "bf16": {"overlap": ["sideways"], "chunk_mb": [0.0]},
    "topk": {"ratio": [0.0, 1.5, -0.1]},
    "local-sgd": {"period": [0, -3], "warmup_steps": [-1]},
    "hier-local-sgd": {"period": [0, (8, {"local_period": 3})], "local_period": [0],
                       "warmup_steps": [-1]},
    "diloco": {"period": [0, (6, {"fragments": 4})], "fragments": [0],
               "delay": [-1, (4, {"period": 8, "fragments": 2})],
               "outer_lr": [0.0, -0.7], "outer_momentum": [-0.1], "alpha": [-0.5, 1.5],
               "nesterov": [(True, {"outer_momentum": 0.0})], "warmup_steps": [-1]},
    "delayed": {"compensate": ["nesterov"], "implicit_momentum": [1.0, -0.5],
                "dc_lambda": [-2.0], "dc_decay": [1.0, -0.1], "warmup_steps": [-1]},
    "powersgd": {"rank": [0]},
    "async-avg": {}, "gossip": {},
    "sparseloco": {"period": [0, -30], "error_decay": [-0.1, 1.5], "density": [0.0, 1.5],
                   "chunk": [0], "bits": [3, 16], "outer_lr": [0.0, -1.0]},
    "demo": {"momentum": [-0.1, 1.0], "chunk": [0], "topk": [0]},
    "muloco": {"period": [0, -30], "compression": ["sparse", "TOPK"], "bits": [3, 16, 32],
               "density": [0.0, 1.5], "chunk": [0], "error_decay": [-0.1, 1.5],
               "outer_lr": [0.0, -0.7], "outer_momentum": [-0.1], "warmup_steps": [-1]},
    "onebit-adam": {"beta1": [-0.1, 1.0], "beta2": [-0.1, 1.0], "eps": [0.0, -1e-8],
                    "freeze_step": [0, -5]},
    "noloco": {"period": [0, -3], "outer_lr": [0.0, -0.7], "outer_momentum": [-0.1, 1.0],
               "gamma": [-0.5]},
    "sparta": {"fraction": [0.0, 1.5, -0.1], "diloco_period": [-1], "outer_lr": [0.0, -0.7],
               "outer_momentum": [-0.1]},
}
# Options whose every value of the right type is taken.
ANY_VALUE = {("powersgd", "seed"), ("noloco", "seed"), ("sparta", "seed"),
             ("onebit-adam", "bias_correction")}

# Text from the command line that is not of an option's type, and Python values that
# are not (a bool is not a number).
WRONG_TYPE = {int: ["abc", "2.5", "", 2.5, True], float: ["abc", "nan", "inf", True],
              bool: ["maybe", "1", 1], str: [3]}


def options_of(name):
    return declared(sync.strategy_class(name).__init__)


def refusal(spec, **options):
    """The message of the ValueError that create(spec, **options) raises."""
    with pytest.raises(ValueError) as refused:
        sync.create(spec, **options)
    return str(refused.value)


def expected(name, option, value):
    """What every refusal looks like: the strategy, the option, what it needs, the value."""
    return re.compile(rf"{re.escape(name)}: {re.escape(option)} must be .+, "
                      rf"got {re.escape(repr(value))}")


def test_the_tables_cover_every_option_of_every_registered_strategy():
    # a strategy or option added later is refused here until its bad values are listed
    assert set(OUT_OF_RANGE) == set(sync.available())
    for name in sync.available():
        options = options_of(name)
        assert "algorithm" in options, f"{name} takes no algorithm (the trainer gives one)"
        ranged = set(OUT_OF_RANGE[name]) | {"algorithm"}
        for option, kind in options.items():
            assert option in ranged or (name, option) in ANY_VALUE, (
                f"{name}: which values does {option} refuse? List them in OUT_OF_RANGE")
            assert kind in WRONG_TYPE or option == "chunk_mb", (name, option, kind)


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_a_value_of_the_wrong_type_names_the_strategy_the_option_and_the_value(name):
    for option, kind in options_of(name).items():
        for value in WRONG_TYPE.get(kind, []):
            message = refusal(name, **{option: value})
            assert expected(name, option, value).fullmatch(message), message
            assert f"must be {WORDS[kind]}," in message, message
            if isinstance(value, str):  # as the command line gives it
                assert refusal(f"{name}:{option}={value}") == message


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_a_value_out_of_range_names_the_strategy_the_option_and_the_value(name):
    cases = [(option, value) for option, values in OUT_OF_RANGE[name].items()
             for value in values] + [("algorithm", "butterfly")]
    for option, case in cases:
        value, beside = case if isinstance(case, tuple) else (case, {})
        message = refusal(name, **{option: value}, **beside)
        assert expected(name, option, value).fullmatch(message), message
        as_text = ":".join([name, f"{option}={value}"]
                           + [f"{key}={other}" for key, other in beside.items()])
        assert refusal(as_text) == message  # the same words from the command line's text


def test_an_option_a_strategy_does_not_take_is_named_with_the_ones_it_does():
    with pytest.raises(TypeError, match=r"^local-sgd takes no option 'perod' \(its options: "
                                        r"period, warmup_steps, algorithm\)$"):
        sync.create("local-sgd:perod=8")
    with pytest.raises(ValueError, match=r"^local-sgd: period given twice"):
        sync.create("local-sgd:period=8", period=4)
    with pytest.raises(ValueError, match="expected KEY=VALUE, got 'period'"):
        sync.create("local-sgd:period")


def test_every_refusal_is_one_line_and_exit_2_from_the_trainer(capsys):
    """In process: each case's last line of stderr is the library's message."""
    cases = [("local-sgd", "period", "abc"), ("topk", "ratio", "abc"),
             ("local-sgd", "period", "0"), ("diloco", "nesterov", "maybe"),
             ("allreduce", "overlap", "sideways"), ("delayed", "dc_decay", "1")]
    for name, option, value in cases:
        message = refusal(f"{name}:{option}={value}")
        for flags in (["--sync", f"{name}:{option}={value}"],
                      ["--sync", name, "--sync-option", f"{option}={value}"]):
            with pytest.raises(SystemExit) as exited:
                cli.parse_args(flags)
            last = capsys.readouterr().err.strip().splitlines()[-1]
            assert exited.value.code == 2
            assert last == f"python -m trainer: error: {message}", last


@pytest.mark.timeout(120)
def test_the_command_given_a_mistyped_value_says_what_is_wrong(tmp_path):
    """As a user types it: the strategy's words, exit 2, no traceback."""
    result = run(trainer_command("--sync", "local-sgd", "--sync-option", "period=abc"),
                 tmp_path, timeout=100, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "python -m trainer: error: local-sgd: period must be a whole number, got 'abc'")
    assert "Traceback" not in result.stderr and "not supported" not in result.stderr


# One spec each: ours with a word, numbers and a bool, and torch's peer (not the library's).
SPECS = {"allreduce:overlap=forward": ("allreduce", {"overlap": "forward"}),
         "local-sgd:period=4:warmup_steps=2": ("local-sgd", {"period": 4, "warmup_steps": 2}),
         "diloco:nesterov=false:outer_lr=1": ("diloco", {"nesterov": False, "outer_lr": 1.0}),
         "ddp-localsgd:period=4": ("ddp-localsgd", {"period": 4})}


@pytest.mark.parametrize("spec", SPECS)
def test_one_spelling_means_one_strategy_in_every_tool(spec):
    name, options = SPECS[spec]
    # the trainer: NAME:KEY=VALUE, and the same with --sync-option
    for flags in (["--sync", spec],
                  ["--sync", name] + [flag for option in spec.split(":")[1:]
                                      for flag in ("--sync-option", option)]):
        args = cli.parse_args(flags)
        assert (args.sync, args.sync_options) == (name, options), flags
        assert type(args.sync_options.get("outer_lr", 0.0)) is float
    # trainer.bench: each --sync as the trainer reads it
    assert bench.parse_args(["--sync", spec]).sync == [spec]
    assert bench.split_entry(spec) == (name, options)
    # trainer.compare: the flags it gives each job, read by the trainer
    compare_name, flags = compare.parse_sync(spec)
    args = cli.parse_args(flags)
    assert (compare_name, args.sync, args.sync_options) == (name, name, options)
    if name in sync.available():  # the library, and a string given to our DDP
        assert sync.parse(spec) == (name, options)
        strategy = sync.create(spec)
        assert vars(strategy) == vars(sync.create(name, **options))
        comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
        wrapped = DistributedDataParallel(torch.nn.Linear(4, 2), comm=comm, sync=spec)
        assert type(wrapped.sync) is type(strategy)
        if name == "allreduce":
            assert wrapped.sync.overlap == "forward"


def test_sync_option_gives_bench_and_compare_an_option_for_every_strategy():
    args = bench.parse_args(["--sync", "local-sgd,diloco", "--sync-option", "period=4"])
    assert args.sync == ["local-sgd:period=4", "diloco:period=4"]
    assert [bench.split_entry(entry)[1] for entry in args.sync] == [{"period": 4}] * 2
    assert compare.parse_sync("local-sgd", [("period", "4")])[1] == [
        "--sync", "local-sgd", "--sync-option", "period=4"]
    with pytest.raises(SystemExit):  # one option given both ways: which one is meant?
        bench.parse_args(["--sync", "local-sgd:period=8", "--sync-option", "period=4"])


def test_optional_literal_and_class_annotations_of_a_users_strategy_convert():
    """A strategy of the user's may declare Optional, `X | None`, Literal or a class of
    its own: text converts to each, a Python value of the kind passes as it is."""
    from typing import Literal, Optional

    from collectives.sync.options import convert, typed

    class Schedule:
        pass

    def options(period: Optional[int] = None, cap: "int | None" = None,
                mode: Literal["sign", "scale"] = "sign", schedule: Schedule = None):
        pass
    schedule = Schedule()
    assert typed("mine", options, dict(period="4", cap="none", mode="scale",
                                        schedule=schedule)) == dict(
        period=4, cap=None, mode="scale", schedule=schedule)
    assert typed("mine", options, dict(period=None, cap=3)) == dict(period=None, cap=3)
    for option, value, needed in [("period", "abc", "a whole number or none"),
                                  ("mode", "both", "one of sign, scale"),
                                  ("schedule", "weekly", "a Schedule")]:
        with pytest.raises(ValueError, match=re.escape(f"mine: {option} must be {needed}, "
                                                       f"got {value!r}")):
            typed("mine", options, {option: value})
    assert convert("mine", "ratio", "0.5", float) == 0.5


def test_an_option_repeated_as_a_flag_is_refused_as_a_repeated_key_is():
    with pytest.raises(ValueError, match="period is given twice"):
        cli.parse_sync("local-sgd", [("period", "4"), ("period", "8")])
    with pytest.raises(ValueError, match="period is given twice"):
        cli.parse_sync("local-sgd:period=4:period=8")
