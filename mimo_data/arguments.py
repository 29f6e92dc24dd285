"""What every command line (mimo-shard, mimo-inspect, mimo-train, mimo-export,
mimo-generate) reads its arguments with alike: kept free of heavy imports, as the commands'
``--help`` is."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys


class Parser(argparse.ArgumentParser):
    """argparse's parser, but an option it does not know is named before a required one
    found missing (argparse checks the required options first, so ``--ouput DIR`` was said
    as ``--output`` missing, never as the typo it is), with the closest known option, a
    subcommand's included (argparse leaves a subcommand's unknown options to the top
    parser, which knows none of its options). Its subcommands' parsers are of this class
    too."""

    def parse_known_args(self, args=None, namespace=None):
        self.words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def options(self) -> list[str]:
        """The options this parser knows, with those of the subcommand its words name."""
        known = [option for action in self._actions for option in action.option_strings]
        for action in self._actions:
            for name, command in (action.choices if isinstance(action.choices, dict)
                                  else {}).items():
                if isinstance(command, Parser) and name in getattr(self, "words", []):
                    known += command.options()
        return known

    def error(self, message: str):
        known = self.options()
        typos = [word for word in (word.split("=")[0] for word in getattr(self, "words", []))
                 if word.startswith("--") and word != "--" and word not in known and not (
                     self.allow_abbrev and any(option.startswith(word) for option in known))]
        guesses = [f"{typo} -> {close[0]}" for typo in typos
                   if (close := difflib.get_close_matches(typo, known, n=1))]
        guess = (f" (did you mean {guesses[0].partition(' -> ')[2]}?)" if len(typos) == 1
                 else f" (did you mean {', '.join(guesses)}?)") if guesses else ""
        if typos and message.startswith("the following arguments are required"):
            message = f"unrecognized arguments: {' '.join(typos)}{guess}; {message}"
        elif typos and message.startswith("unrecognized arguments"):
            message += guess
        super().error(message)


def user_path(value: str) -> str:
    """A path given on a command line, its leading ``~`` expanded: the shell leaves
    ``--output=~/x`` and a quoted ``'~/x'`` as written (argparse's ``type`` of every path
    option; a URL or hub name is unchanged)."""
    return os.path.expanduser(value)


def at_least(minimum: int, maximum: int | None = None):
    """An argparse type: a whole number >= ``minimum`` (and <= ``maximum``; argparse's
    "invalid whole number value" for one that is not a number)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text} is above {maximum}")
        return value
    parse.__name__ = "whole number"
    return parse


# a seed as training takes one (train.seed): the --seed of the commands that plan or sample
# as a run does (mimo-inspect plan, the dry run, mimo-generate)
SEED = at_least(0, 2**32 - 1)
# the seed of a run that sets none (train.seed's default): the plan's and the dry run's
# default too, so that a plan without --seed draws the run's order
RUN_SEED = 1


def positive(kind):
    """An argparse type: a finite number of ``kind`` (int or float) > 0."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not > 0")
        if value == math.inf:
            raise argparse.ArgumentTypeError(f"{text} is not finite")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def fraction(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction between 0 and 1")
    return value
