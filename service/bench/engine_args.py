"""Engine options of `conveyor bench`, forwarded to the `conveyor serve` it starts.

The bench parser takes the same engine flags as `conveyor serve`
(`service.engine_args.add_engine_args`);
`serve_args` turns the ones the user set back into `conveyor serve` arguments.
"""

from __future__ import annotations

import argparse
import shlex

from service.engine_args import add_engine_args, build_parser as serve_parser


def engine_parser() -> argparse.ArgumentParser:
    """A parser holding only the engine flags of `conveyor serve`."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return parser


def serve_args(ns: argparse.Namespace) -> list[str]:
    """The `conveyor serve` flags that reproduce every engine option of `ns` that differs
    from its default, e.g. ["--max-num-seqs", "8", "--no-enable-prefix-caching"].

    Values are written with str(), which each flag's own type parses back (e.g. a
    --kv-cache-memory of 2GiB comes back as "2147483648").
    """
    args: list[str] = []
    # argparse has no public list of a parser's actions; `_actions` is stable since 2.7.
    for action in engine_parser()._actions:
        long = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if not long or not hasattr(ns, action.dest):
            continue
        value = getattr(ns, action.dest)
        if value == action.default:
            continue
        flag = long[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            args.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true / store_false / store_const
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args


def check_serve_args(args: list[str]) -> None:
    """Parse `args` as `conveyor serve` would, before any server is started (a model load
    costs ~30 s). Raises ValueError when it would refuse them (argparse has printed why
    to stderr)."""
    try:
        serve_parser().parse_args(["serve", *args])
    except SystemExit:
        raise ValueError(f"`conveyor serve` rejects {shlex.join(args)!r} (see the message "
                         "above)") from None
