"""The training config's fields read by their types: a field's annotation is the whole rule for
its value. ``build`` makes a section (a dataclass) from a mapping, each value parsed by its
field's type (a section, ``dict[str, Section]``, a list, a scalar; unknown keys are errors);
``check_fields`` checks a built section's values against the choices and ranges its
annotations carry (``Annotated[str, OneOf(...)]``, ``Annotated[int, Range(1)]``), so a config
changed in code is checked as a loaded one is. Every error names the full dotted key.

Read with ``typing.get_type_hints`` rather than by a validation library: pydantic v2
(``extra="forbid"``) would do the same for a new dependency of every install and its own error
wording, which the CLI would have to rewrite to name the key as it does now; the rules between
fields stay code either way (``TrainConfig.validate``).
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from mimo_data.errors import meant
from mimo_train.errors import TrainConfigError


@dataclass(frozen=True)
class OneOf:
    """A field's allowed values (``Annotated[str, OneOf(...)]``), checked by ``validate``."""
    values: tuple
    hint: str = ""


@dataclass(frozen=True)
class Range:
    """A number field's bounds (``Annotated[int, Range(1)]``), checked by ``validate``;
    ``open_low`` / ``open_high``: the bound itself is out."""
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    hint: str = ""

    def holds(self, value: float) -> bool:
        return (self.low is None or value > self.low or (value == self.low and not self.open_low)
                ) and (self.high is None or value < self.high
                       or (value == self.high and not self.open_high))

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {_number(self.low)}"
        return (f"in {'(' if self.open_low else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.open_high else ']'}")


def _number(value) -> str:
    """A bound as written: a whole one in full (4294967295, not 4.29497e+09)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


Count = Annotated[int, Range(0)]            # 0 or more
Positive = Annotated[int, Range(1)]         # 1 or more


def build(cls, data, where: str):
    """Dataclass ``cls`` from a mapping, recursively, each value parsed by its field's type
    (``_parse``); unknown keys are errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TrainConfigError(f"{where.rstrip('.') or 'the config'} must be a mapping, "
                               f"got {data!r}")
    hints = _hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        # keys another file holds (``ELSEWHERE``: key -> where it goes), named where they go
        elsewhere = "".join(f"; {where}{k} goes in {cls.ELSEWHERE[k]}" for k in unknown
                            if k in getattr(cls, "ELSEWHERE", {}))
        guess = meant(unknown, hints, where)
        raise TrainConfigError(f"unknown key(s) {', '.join(where + k for k in unknown)}{guess}; "
                               f"known under {where or 'the top level'}: {', '.join(hints)}"
                               f"{elsewhere}")
    return cls(**{name: _parse(hints[name], copy.deepcopy(value), where + name)
                  for name, value in data.items()})


def _hints(cls: type) -> dict[str, Any]:
    """The fields' types of dataclass ``cls``, their annotations evaluated (choices and
    ranges kept; once per class)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return _HINTS[cls]


_HINTS: dict[type, dict[str, Any]] = {}


def _parse(kind: Any, value: Any, key: str) -> Any:
    """``value`` read as a field of type ``kind``: a section (a dataclass; an empty one is
    its defaults), a mapping of names to sections (``dict[str, EncoderConfig]``), a list, or
    a scalar; a float also takes text such as ``1e-4``, which YAML 1.1 does not read as a
    number. Choices and ranges are ``validate``'s."""
    kind = _bare(kind)
    if typing.get_origin(kind) in (types.UnionType, typing.Union):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _parse(option, value, key)
            except TrainConfigError as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        raise TrainConfigError(f"{key} is {value!r} ({type(value).__name__}): it must be "
                               f"{' or '.join(_name(o) for o in options)}")
    if dataclasses.is_dataclass(kind):                # (built already: ``validate``)
        return value if isinstance(value, typing.cast(type, kind)) else \
            build(kind, value, f"{key}.")
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is dict and args and dataclasses.is_dataclass(_bare(args[1])):
        if not isinstance(value or {}, dict):
            raise TrainConfigError(f"{key} must be a mapping of module name to settings, got "
                                   f"{value!r}")
        return {name: _parse(args[1], spec, f"{key}.{name}")
                for name, spec in (value or {}).items()}
    if origin is list:
        if not isinstance(value, list):
            raise TrainConfigError(f"{key} is {value!r} ({type(value).__name__}): it must be "
                                   f"{_name(kind)}" + (f", e.g. {key}=[{value}] on the command "
                                                       "line" if isinstance(value, str) else ""))
        return [_parse(args[0], item, key) for item in value] if args else value
    return _scalar(origin or kind, value, key)


def _scalar(kind: type, value: Any, key: str) -> Any:
    if kind is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    elif isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool):
        return value
    raise TrainConfigError(f"{key} is {value!r} ({type(value).__name__}): it must be "
                           f"{_name(kind)}{_whole_hint(kind, value)}")


def _whole_hint(kind: type, value: Any) -> str:
    """How to write a whole number given as ``1e3`` (YAML's string) or ``1000.0``."""
    if kind is not int or isinstance(value, bool) or not isinstance(value, (str, float)):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    return f" (write it as {int(number)})" if number.is_integer() else ""


def _bare(kind: Any) -> Any:
    """``kind`` without its ``Annotated`` choices or range."""
    return typing.get_args(kind)[0] if typing.get_origin(kind) is Annotated else kind


def _name(kind: Any) -> str:
    kind = _bare(kind)
    return "None" if kind is type(None) else getattr(kind, "__name__", str(kind))


def check_fields(config, where: str) -> None:
    """Every field of ``config`` (recursively) of its type, in its choices and range
    (``OneOf``, ``Range``): ``TrainConfigError`` naming the key. Run by ``validate``, so a
    config built or changed in code is checked as a loaded one is."""
    for name, kind in _hints(type(config)).items():
        value, key = getattr(config, name), f"{where}{name}"
        _parse(kind, value, key)
        if value is None:
            continue
        for check in _constraints(kind):
            if isinstance(check, OneOf) and value not in check.values:
                raise TrainConfigError(
                    f"{key} is {value!r}: use {_either(check.values)}"
                    + (f" ({check.hint})" if check.hint else ""))
            if isinstance(check, Range) and not check.holds(value):
                raise TrainConfigError(f"{key} is {value}: it must be {check}"
                                       + (f" ({check.hint})" if check.hint else ""))
        if dataclasses.is_dataclass(value):
            check_fields(value, f"{key}.")
        elif isinstance(value, dict):
            for module, section in value.items():
                if dataclasses.is_dataclass(section):
                    check_fields(section, f"{key}.{module}.")


def _either(values) -> str:
    """``a, b or c``."""
    *rest, last = map(str, values)
    return f"{', '.join(rest)} or {last}" if rest else last


def _constraints(kind: Any) -> list:
    """The ``OneOf`` / ``Range`` of a field's type (inside an optional one too)."""
    if typing.get_origin(kind) in (types.UnionType, typing.Union):
        return [c for option in typing.get_args(kind) for c in _constraints(option)]
    if typing.get_origin(kind) is Annotated:
        return [c for c in kind.__metadata__ if isinstance(c, (OneOf, Range))]
    return []
