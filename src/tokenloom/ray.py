"""Ray Serve's own CLI runs the same application as `tokenloom serve --ray`:

    serve run tokenloom.ray:app model=/path/to/checkpoint num_replicas=2 dtype=bfloat16

Each key=value is one of `tokenloom serve`'s flags (underscores for dashes; `true`/`false` for switches), read by
the same parser, so the two entry points cannot disagree about a flag.
"""

from __future__ import annotations

from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.server_config import ServerConfig


def configs_from_serve_args(args: dict[str, str]) -> tuple[ServerConfig, EngineConfig]:
    """`tokenloom serve` configs from `serve run` key=value arguments; ValueError for a flag serve does not take."""
    from tokenloom.cli import build_parser, config_from_args, engine_config_from_args

    argv = ["serve", "--ray"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value.lower() in ("true", "false"):  # a switch: --flag or --no-flag
            argv.append(flag if value.lower() == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, value]
    try:
        parsed = build_parser().parse_args(argv)
    except SystemExit:
        message = f"tokenloom.ray:app takes `tokenloom serve` flags; these were not all: {sorted(args)}"
        raise ValueError(message) from None
    return config_from_args(ServerConfig, parsed), engine_config_from_args(parsed)


def app(args: dict[str, str]) -> Any:
    """The application builder `serve run tokenloom.ray:app key=value ...` calls."""
    from tokenloom.replicas.ray_serve import build_ray_app

    return build_ray_app(*configs_from_serve_args(args))
