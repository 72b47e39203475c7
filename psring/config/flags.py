"""The flags of RunConfig: one per field (``batch_size`` is ``--batch-size``), typed
from its default, in one argument group per section title (psring.config.sections),
so the CLI, the worker entry point and ``manifest.json`` never disagree.

    >>> parser = argparse.ArgumentParser()
    >>> add_config_flags(parser)
    >>> config_from_args(parser.parse_args(["--lr", "0.1"])).lr
    0.1
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from psring.config.run import RunConfig, flag_name, literal_choices
from psring.config.sections import SECTIONS, own_fields
from psring.config.validate import validate


def add_config_flags(parser: argparse.ArgumentParser, defaults: RunConfig | None = None,
                     suppress: bool = False, only: tuple[str, ...] | None = None) -> None:
    """Add one flag per RunConfig field, typed from the field's default, each in its
    section's argument group. With ``suppress`` a flag not given is absent from the
    parsed namespace (which flags a user gave; see :func:`given_fields`); ``only`` adds
    just those fields' flags (a command that takes some of psring run's)."""
    shown: dict[str, tuple[list[str], list[str]]] = {}  # title: (docs, fields)
    for section in SECTIONS:
        names = [n for n in own_fields(section) if only is None or n in only]
        if names:
            docs, listed = shown.setdefault(section.title, ([], []))
            docs.append(section.__doc__)
            listed.extend(names)
    byname = {f.name: f for f in fields(RunConfig)}
    for title, (docs, names) in shown.items():
        group = parser.add_argument_group(title, " ".join(docs))
        for name in names:
            _add_flag(group, byname[name], defaults, suppress)


def _add_flag(group: Any, f: Any, defaults: RunConfig | None, suppress: bool) -> None:
    default = argparse.SUPPRESS if suppress else \
        getattr(defaults, f.name) if defaults else f.default
    kw = {"help": f.metadata["help"]}
    if f.name in literal_choices() and f.metadata.get("argparse_choices", True):
        kw["choices"] = literal_choices()[f.name]
    if f.metadata.get("repeatable"):
        # given again, or comma-separated: one string, the entries joined (config_from_args)
        group.add_argument(flag_name(f.name), dest=f.name, action="append",
                           default=default if suppress else None,
                           metavar=f.name.upper().split("_")[-1], **kw)
        return
    if isinstance(f.default, bool):
        # --flag / --no-flag: a string boolean ("--trace False") would mean True
        group.add_argument(flag_name(f.name), dest=f.name, default=default,
                           action=argparse.BooleanOptionalAction, **kw)
        return
    group.add_argument(flag_name(f.name), dest=f.name, type=type(f.default),
                       default=default, metavar=f.name.upper().split("_")[0], **kw)


def given_fields(argv: list[str]) -> set[str]:
    """The RunConfig fields set explicitly in a `psring run` argv."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_flags(parser, suppress=True)
    known, _ = parser.parse_known_args(argv)
    return set(vars(known))


def flag_values(args: argparse.Namespace, names: Any) -> dict[str, Any]:
    """The parsed values of fields ``names``, a repeatable flag's entries joined by
    commas (--kill-worker 1:5 --kill-worker 2:8: "1:5,2:8"), as RunConfig holds them."""
    byname = {f.name: f for f in fields(RunConfig)}
    values = {}
    for name in names:
        value = getattr(args, name)
        if byname[name].metadata.get("repeatable"):
            value = ",".join(value) if isinstance(value, list) else value or byname[name].default
        values[name] = value
    return values


def config_from_args(args: argparse.Namespace, **overrides: Any) -> RunConfig:
    """The validated config of parsed flags (psring.config.validate): what ``psring
    run`` launches and a worker runs."""
    values = flag_values(args, [f.name for f in fields(RunConfig)])
    values.update(overrides)
    return validate(RunConfig(**values))
