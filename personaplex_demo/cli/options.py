"""Command-line options declared once, on the fields of a frozen config dataclass: each field made
with `option(...)` carries its help, its environment variable and its checks. A flag wins over its
variable, a variable over the field's default; a bad value from either is a one-line parser error."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Check = Callable[[Any], str | None]  # a complaint about a value, or None when it is fine

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_KIND_WORDS = {int: "a whole number", float: "a number"}


@dataclass(frozen=True)
class Option:
    help: str
    env: str | None = None
    choices: tuple[str, ...] | None = None
    check: Check | None = None
    shown_default: str | None = None  # what --help and the docs show when the default is a placeholder (None)
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # text to value for a type of its own; a ValueError says what is wrong
    secret: bool = False  # --help says whether it is set, never the value
    # The flag's and the variable's former names, still taken (a rename never breaks a command line).
    formerly: tuple[str, ...] = ()


def option(default: Any, help: str, **settings: Any) -> Any:
    """A dataclass field that is also a command-line flag (`--field-name`) and, with `env`, a variable;
    `settings` are `Option`'s."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **settings)})


def at_least(minimum: float) -> Check:
    return lambda value: None if value >= minimum else f"must be at least {minimum:g}"


def between(low: float, high: float) -> Check:
    return lambda value: None if low <= value <= high else f"must be between {low:g} and {high:g}"


def positive(value: float) -> str | None:
    return None if value > 0 else "must be greater than 0"


@dataclass(frozen=True)
class Spec:
    """One option as the parser sees it: the field's name, its plain type, its default and its Option."""

    name: str
    kind: type
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def shown(self, value: Any) -> str:
        """A value as --help and the docs write it."""
        if value is None:
            return self.option.shown_default or "none"
        if self.kind is bool:
            return "on" if value else "off"
        if self.kind is float:
            return f"{value:g}"
        return str(value)

    def convert(self, text: str) -> Any:
        """Text from the command line or the environment to a checked value; argparse reports the error."""
        text = text.strip()
        if self.option.parse is not None:
            try:
                value: Any = self.option.parse(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        elif self.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(_TRUE + _FALSE)}")
            value = text.lower() in _TRUE
        else:
            try:
                value = self.kind(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not {_KIND_WORDS.get(self.kind, self.kind.__name__)}"
                                                 ) from None
        if self.option.choices and value not in self.option.choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(self.option.choices)}")
        complaint = self.option.check(value) if self.option.check else None
        if complaint:
            raise argparse.ArgumentTypeError(f"{complaint}, not {text}")
        return value


def specs(cls: type) -> list[Spec]:
    """The options of dataclass `cls`, in field order."""
    hints = typing.get_type_hints(cls)
    result = []
    for f in dataclasses.fields(cls):
        if (opt := f.metadata.get("option")) is not None:
            plain = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]  # `str | None` -> str
            result.append(Spec(f.name, plain[0] if plain else hints[f.name], f.default, opt))
    return result


def env_help(cls: type, extra: Mapping[str, str] | None = None) -> str:
    """The environment variables, one per line, for the end of --help."""
    rows = [(s.option.env, s.flag) for s in specs(cls) if s.option.env] + list((extra or {}).items())
    width = max(len(name) for name, _ in rows) + 2
    return "environment variables (a flag wins over its variable, a variable over the default):\n" + "\n".join(
        f"  {name.ljust(width)}{meaning}" for name, meaning in rows)


def add_options(parser: argparse.ArgumentParser, cls: type, environ: Mapping[str, str],
                presets: Mapping[str, tuple[Any, str]] | None = None, names: tuple[str, ...] | None = None) -> None:
    """The flags of `cls`'s options (all, or those in `names`) on `parser`. `presets` maps a field to a
    (default, reason) that stands in for its own default (the host on a Space); its variable still wins.
    An invalid variable in `environ` exits here, with status 2 as argparse does for a bad flag."""
    for spec in specs(cls):
        if names is not None and spec.name not in names:
            continue
        default, source = (presets or {}).get(spec.name, (spec.default, None))
        old_flags = [name for name in spec.option.formerly if name.startswith("--")]
        variables = [spec.option.env] if spec.option.env else []
        variables += [name for name in spec.option.formerly if not name.startswith("--")]
        variable = next((name for name in variables if environ.get(name, "").strip()), None)
        if variable is not None:  # an empty variable counts as unset
            try:
                default = spec.convert(environ[variable])
            except argparse.ArgumentTypeError as exc:  # one line, without the usage text a flag error has
                parser.exit(2, f"{parser.prog}: error: {variable}: {exc}\n")
            source = f"from {variable}"
        shown = ("set" if spec.option.secret and default else spec.shown(default)) + (f", {source}" if source else "")
        formerly = f" (formerly {' and '.join(spec.option.formerly)}, still taken)" if spec.option.formerly else ""
        help_text = f"{spec.option.help} (default: {shown}){formerly}".replace("%", "%%")
        if spec.kind is bool:
            parser.add_argument(spec.flag, *old_flags, dest=spec.name, action="store_true", default=default,
                                help=help_text)
        else:
            metavar = spec.option.metavar or ("{" + ",".join(spec.option.choices) + "}" if spec.option.choices
                                              else spec.name.upper())
            parser.add_argument(spec.flag, *old_flags, dest=spec.name, type=spec.convert, default=default,
                                metavar=metavar, help=help_text)
