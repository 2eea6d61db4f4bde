"""The `conveyor` argument parser (`build_parser`), and the command-line flags generated
from the config dataclasses: one option, one definition. `service.cli` (dispatch),
`service.bench` and `service.cluster` import it; it imports none of them but the cluster's
flag definitions.

Every field of `ModelConfig`, `CacheConfig`, `SchedulerConfig` (with its
`PolicyOptions`), `EngineConfig` and `ServerConfig` declared with
`service.core.config.option(...)` becomes `--field-name` with that help, default,
choices and parser; `engine_config(ns)` / `server_config(ns)` build the frozen
configs back from parsed flags (whose own `__post_init__` checks the values).
A field without option metadata is not a flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from typing import Any

from service.cluster.config import ClusterConfig
from service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig

__all__ = ["add_config_args", "add_engine_args", "add_server_args", "build_config",
           "build_parser", "cluster_config", "engine_config", "server_config"]

# (title of the --help group, config class); nested config fields (SchedulerConfig.policy)
# are flattened into their parent's group
ENGINE_GROUPS = (("model", ModelConfig), ("KV cache", CacheConfig),
                 ("scheduling", SchedulerConfig), ("engine", EngineConfig))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(cls: type, name: str) -> Any:
    """The non-None type of field `name` of `cls` (e.g. int for `int | None`)."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return hint


def add_config_args(group: Any, cls: type) -> None:
    """A flag per field of `cls` declared with `option(...)`, added to `group`."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = _scalar_type(cls, f.name)
        kw: dict[str, Any] = {"help": meta["help"], "dest": f.name}
        none = meta.get("none")
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
            kw["default"] = default
        else:
            parse = meta.get("parse") or kind
            if none is not None:  # the word stays a word here (help, errors); build_config maps it
                kw["type"] = lambda text, _p=parse, _n=none: text if text == _n else _p(text)
                kw["default"] = none if default is None else default
            else:
                kw["type"] = parse
                kw["default"] = default
            if "choices" in meta:
                kw["choices"] = list(meta["choices"])
                kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
            elif "metavar" in meta:
                kw["metavar"] = meta["metavar"]
        group.add_argument(_flag(f.name), **kw)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (shared by `serve`, `bench` and the engine-only benchmark)."""
    for title, cls in ENGINE_GROUPS:
        group = parser.add_argument_group(title)
        add_config_args(group, cls)
        if cls is not EngineConfig:  # EngineConfig's parts have groups of their own
            for hint in typing.get_type_hints(cls).values():
                if dataclasses.is_dataclass(hint):  # e.g. SchedulerConfig.policy
                    add_config_args(group, hint)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The network flags of `conveyor serve`."""
    add_config_args(parser.add_argument_group("network"), ServerConfig)


def build_config(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` from the parsed flags of its option fields (nested configs too), then
    `overrides`; its `__post_init__` checks the values (ValueError)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            kw[f.name] = build_config(hint, ns)
        elif "help" in f.metadata and hasattr(ns, f.name):
            value = getattr(ns, f.name)
            none = f.metadata.get("none")
            kw[f.name] = None if none is not None and value == none else value
    return cls(**{**kw, **overrides})


def _in_flag_terms(e: ValueError, *classes: type) -> ValueError:
    """The config's error with its snake_case field names written as their flags
    ("batch_invariant must be ..." -> "--batch-invariant must be ...")."""
    text = str(e)
    for cls in classes:
        for f in dataclasses.fields(cls):
            if "help" in f.metadata and "_" in f.name:
                text = re.sub(rf"(?<![\w-]){f.name}\b", _flag(f.name), text)
    return ValueError(text)


def engine_config(ns: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags (raises ValueError for bad values, naming
    the flags)."""
    try:
        return build_config(EngineConfig, ns)
    except ValueError as e:
        parts = [cls for _, cls in ENGINE_GROUPS]
        parts += [h for cls in parts for h in typing.get_type_hints(cls).values()
                  if dataclasses.is_dataclass(h)]
        raise _in_flag_terms(e, *parts) from e


def server_config(ns: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed network flags; --api-key falls back to $CONVEYOR_API_KEY
    (raises ValueError for bad values)."""
    config = build_config(ServerConfig, ns)
    if config.api_key is None and os.environ.get("CONVEYOR_API_KEY"):
        config = dataclasses.replace(config, api_key=os.environ["CONVEYOR_API_KEY"])
    return config


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """`serve --replicas N`: engine replicas on Ray Serve (the `cluster` extra)."""
    g = p.add_argument_group("cluster (Ray Serve; needs the cluster extra)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve with N engine replicas behind one endpoint on Ray Serve "
                        "(prefix-cache-affinity routing); None = one in-process engine")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. ray://head:10001 or head:6379); None = "
                        "a Ray instance already running on this machine, else a new local one")
    add_config_args(g, ClusterConfig)


def cluster_config(a: argparse.Namespace) -> ClusterConfig:
    """The cluster flags as a ClusterConfig (raises ValueError for bad values)."""
    return build_config(ClusterConfig, a, num_replicas=ClusterConfig.num_replicas
                        if a.replicas is None else a.replicas)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor",
                                     description="Conveyor: an LLM streaming server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over WebSockets",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_args(serve)
    add_engine_args(serve)
    add_cluster_args(serve)
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"],
                       help="log level; JSON lines unless stderr is a terminal")
    serve.add_argument("--loop", default="uvloop" if _has_uvloop() else "asyncio",
                       choices=["asyncio", "uvloop"], help="event loop implementation")
    sub.add_parser("chat", help="terminal chat client (see `conveyor chat --help`)",
                   add_help=False)
    sub.add_parser("bench", help="load generator and benchmarks (see `conveyor bench --help`)",
                   add_help=False)
    return parser
