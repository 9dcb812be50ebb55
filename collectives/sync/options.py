"""A strategy's options: how they are spelled, how text becomes a value, how a bad one
is reported.

One spelling everywhere a strategy is named (`sync.create`, a string `sync=` given to
DistributedDataParallel, the trainer's --sync, trainer.bench, trainer.compare): its
name, then each option after a colon.

    allreduce:overlap=forward
    local-sgd:period=8:warmup_steps=20

(On the command line, `--sync-option KEY=VALUE` adds the same options one flag at a
time; an option given both ways is refused, not silently overridden.)

On the command line every value arrives as text. The strategy's constructor already
says what each option is (`def __init__(self, period: int = 8, ...)`), so `typed`
turns the text into that type, and checks values that are not text against it, in
this one place for every strategy. What a value must be beyond its type (a period of
at least 1, a ratio in (0, 1]) only the strategy knows: it says so with `need`. Both
word a mistake the same way, naming the strategy, the option, what it got and what it
needs, in one line that the command-line tools print as it is:

    local-sgd: period must be a whole number, got 'abc'
    local-sgd: period must be at least 1, got 0
    local-sgd takes no option 'perod' (its options: period, warmup_steps, algorithm)
"""
from __future__ import annotations

import inspect
import math
import types
import typing
from typing import Any, Callable, Dict, Mapping, Tuple

from .. import algorithms


def need(ok: bool, owner: str, option: str, value: Any, what: str) -> None:
    """Raise ValueError("OWNER: OPTION must be WHAT, got VALUE") unless `ok`."""
    if not ok:
        raise ValueError(f"{owner}: {option} must be {what}, got {value!r}")


def split_option(text: str) -> Tuple[str, str]:
    """'period=8' -> ('period', '8'): one option as text, its value still text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def split(spec: str) -> Tuple[str, Dict[str, str]]:
    """'local-sgd:period=8:warmup_steps=20' -> ('local-sgd', {'period': '8',
    'warmup_steps': '20'}): the name and its options, values still text."""
    name, *texts = spec.split(":")
    options: Dict[str, str] = {}
    for text in texts:
        key, value = split_option(text)
        if key in options:
            raise ValueError(f"{name}: {key} is given twice in {spec!r}")
        options[key] = value
    return name, options


def merged(owner: str, first: Mapping[str, Any], second: Mapping[str, Any]) -> Dict[str, Any]:
    """The options of both sources; one named in both is refused (which should win, the
    spec's or the flag's, is not for us to guess)."""
    twice = sorted(set(first) & set(second))
    if twice:
        raise ValueError(f"{owner}: {', '.join(twice)} given twice (after the name and "
                         "again as an option)")
    return {**first, **second}


def declared(function: Callable) -> Dict[str, Any]:
    """The options `function` takes, each with its declared type: its parameters that
    have a default (a constructor's `self`, and a positional name before the options,
    are not options). An option with no annotation takes any value."""
    hints = typing.get_type_hints(function)
    return {name: hints.get(name, Any)
            for name, parameter in inspect.signature(function).parameters.items()
            if parameter.default is not inspect.Parameter.empty}


def typed(owner: str, function: Callable, options: Mapping[str, Any]) -> Dict[str, Any]:
    """`options` as `function` (a strategy's __init__) declares them: text converted to
    the option's type, other values checked against it. An option it does not take is
    a TypeError (as Python says of an unknown keyword), a value of the wrong type a
    ValueError; both name the owner and the option."""
    kinds = declared(function)
    unknown = [key for key in options if key not in kinds]
    if unknown:
        raise TypeError(f"{owner} takes no option {unknown[0]!r} (its options: "
                        f"{', '.join(kinds) or 'none'})")
    return {key: convert(owner, key, value, kinds[key]) for key, value in options.items()}


def convert(owner: str, option: str, value: Any, kind: Any) -> Any:
    """One value as `kind` (int, float, bool, str, None, a Literal, a Union or
    Optional of them, a class, or Any): text is converted, anything else must already
    be of the kind (a bool is not a number)."""
    if kind is Any:
        return value
    if kind is type(None):  # Optional[...]'s other half: None, or "none" on a command line
        need(value is None or (isinstance(value, str) and value.lower() == "none"),
             owner, option, value, "none")
        return None
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # Union[float, str],
        for each in typing.get_args(kind):                           # int | None
            try:
                return convert(owner, option, value, each)
            except (ValueError, TypeError):
                pass
        if not isinstance(value, str) and any(each not in WORDS and each is not type(None)
                                              for each in typing.get_args(kind)):
            return value  # a member we cannot check (a class of the user's): as given
        words = " or ".join(WORDS.get(each, "none" if each is type(None) else
                                      getattr(each, "__name__", str(each)))
                            for each in typing.get_args(kind))
        raise ValueError(f"{owner}: {option} must be {words}, got {value!r}")
    if typing.get_origin(kind) is typing.Literal:  # one of some values: text matched
        choices = typing.get_args(kind)          # by how the value is written
        for choice in choices:
            if value == choice or (isinstance(value, str) and value == str(choice)):
                return choice
        raise ValueError(f"{owner}: {option} must be one of "
                         f"{', '.join(map(str, choices))}, got {value!r}")
    if kind not in WORDS:  # a class of the strategy's own: only its instances
        need(isinstance(kind, type) and isinstance(value, kind), owner, option, value,
             f"a {getattr(kind, '__name__', kind)}")
        return value
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        need(isinstance(value, bool), owner, option, value, WORDS[bool])
        return value
    if kind is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        need(isinstance(value, int) and not isinstance(value, bool), owner, option, value,
             WORDS[int])
        return value
    if kind is float:
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        need(isinstance(number, (int, float)) and not isinstance(number, bool)
             and math.isfinite(number), owner, option, value, WORDS[float])
        return float(number)
    if kind is str:
        need(isinstance(value, str), owner, option, value, WORDS[str])
        return value
    raise TypeError(f"{owner}: option {option} is declared as {kind!r}, which options "
                    "cannot be converted to")


def one_of(owner: str, option: str, value: Any, choices) -> None:
    """ValueError unless `value` is one of `choices`, which the message lists."""
    need(value in choices, owner, option, value, f"one of {', '.join(choices)}")


def check_algorithm(owner: str, algorithm: str) -> None:
    """ValueError unless `algorithm` names an all-reduce algorithm (or "auto")."""
    one_of(owner, "algorithm", algorithm, algorithms.names("all_reduce"))


# What each type is called in an error.
WORDS = {int: "a whole number", float: "a finite number", bool: "true or false",
         str: "text"}
