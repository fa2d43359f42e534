"""The command line: ``tokenloom generate``. Engine flags are spelled as vLLM spells them."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import typing
from pathlib import Path
from typing import Any

from tokenloom.config import PARTS, EngineConfig
from tokenloom.server_config import ServerConfig

T = typing.TypeVar("T")

SAMPLING_FLAGS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
}


# vLLM's serve flags that change nothing here: accepted, so a vLLM command line runs as it is.
VLLM_FLAGS_ACCEPTED = {
    "--trust-remote-code": "tokenloom runs no checkpoint's own code (only the architectures it builds in)",
    "--disable-log-requests": "requests are not logged unless --enable-log-requests (vLLM's newer default too)",
    "--disable-custom-all-reduce": "tensor-parallel ranks all-reduce through torch.distributed only",
}
# vLLM's choices of what a model is served as: every model serves both generation and /v1/embeddings (last-token
# pooling) here, so each choice below is taken and changes nothing; one this cannot honour (classify) is refused.
BOTH_SERVED = "a model serves generation and /v1/embeddings (last-token pooling, normalized) at once"
VLLM_CHOICES_ACCEPTED = {
    "--runner": ("auto", "generate", "pooling"),
    "--convert": ("auto", "none", "embed"),
    "--task": ("auto", "generate", "embed", "embedding"),
}
# vLLM's serve flags for what tokenloom does not do, refused by name with the reason (argparse would only say
# "unrecognized").
VLLM_FLAGS_REFUSED = {
    "--api-server-count": "one API process serves; --core-process runs the engine core in a process of its own",
    "--data-parallel-size": "replicas are Ray Serve's here: --ray --num-replicas N",
    "--pipeline-parallel-size": "models larger than a device are split by --tensor-parallel-size only",
    "--pooler-config": "an embedding is the last token's final hidden state, normalized (a request's dimensions and "
    "normalize change the rest)",
    "--revision": "a local checkpoint directory is served as it is; nothing is downloaded",
    "--download-dir": "nothing is downloaded: give a local checkpoint directory",
    "--load-format": "checkpoints load from safetensors (or the embedded GGUF)",
    "--guided-decoding-backend": "structured output is always xgrammar's",
    "--enable-sleep-mode": "the weights stay loaded",
    "--limit-mm-per-prompt": "only text is served (no multimodal inputs)",
    "--kv-transfer-config": "no disaggregated prefill: one engine computes a request's KV",
    "--cpu-offload-gb": "the weights stay on the device",
    "--headless": "the engine serves behind its own API server (--core-process puts the core apart)",
    "--compilation-config": "the step is compiled or not (--enforce-eager), with torch.compile's defaults",
    "--max-cudagraph-capture-size": "CUDA graphs are captured up to --max-num-seqs",
    "--tokenizer-mode": "the checkpoint's tokenizer.json is read with the tokenizers library",
    "--distributed-executor-backend": "tensor-parallel ranks are processes of their own (torch.distributed)",
    "--structured-outputs-config": "structured output is xgrammar's; its limits are --max-grammar-bytes and more",
    "--chat-template-content-format": "message content is text (a list of text parts is joined)",
    "--log-config-file": "logging is set by --log-level and --uvicorn-log-level",
    "--enable-server-load-tracking": "the load is in /metrics (tokenloom:num_requests_running and _waiting)",
}


def refused_vllm_flag(argv: list[str]) -> str | None:
    """Why the first of vLLM's flags tokenloom does not take in argv is refused (None if there is none)."""
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in VLLM_FLAGS_REFUSED:
            return f"{flag} (vLLM's) is not supported: {VLLM_FLAGS_REFUSED[flag]}"
    return None


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """argv with vLLM's ``--config FILE`` replaced by the flags the YAML file holds, each unless argv gives it too
    (the command line wins). ValueError (or OSError) saying what in the file is wrong."""
    at = next((i for i, token in enumerate(argv) if token == "--config" or token.startswith("--config=")), None)
    if at is None:
        return argv
    path = argv[at].partition("=")[2] if "=" in argv[at] else (argv[at + 1] if at + 1 < len(argv) else "")
    rest = argv[:at] + argv[at + (1 if "=" in argv[at] else 2) :]
    import yaml

    data = yaml.safe_load(Path(path).read_text()) if path else None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must hold a mapping of flags to their values")
    actions = _subcommand_actions(parser or build_parser(), argv[0] if argv else "")
    given = {token.split("=", 1)[0] for token in rest if token.startswith("--")}
    if len(rest) > 1 and not rest[1].startswith("-"):  # `serve MODEL`: the command line names the model
        given.add("--model")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if (refused := refused_vllm_flag([flag])) is not None:
            raise ValueError(f"--config {path}: {refused}")
        if flag not in actions:
            raise ValueError(f"--config {path}: {key!r} is not a flag of `tokenloom {argv[0]}`")
        if {flag, "--no-" + flag[2:]} & given:
            continue
        flags += _config_flag(path, flag, value, actions[flag])
    return [*rest, *flags]


def _subcommand_actions(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = subparsers.choices.get(command)
    return dict(sub._option_string_actions) if sub is not None else {}


def _config_flag(path: str, flag: str, value: Any, action: argparse.Action) -> list[str]:
    """A config file's entry as command-line tokens."""
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {flag[2:]} is true or false")
        no = "--no-" + flag[2:]
        return [flag] if value else ([no] if no in action.option_strings else [])
    if isinstance(value, list):
        if action.nargs not in ("+", "*"):
            raise ValueError(f"--config {path}: {flag[2:]} takes one value, not a list")
        return [flag, *map(str, value)]
    return [flag, json.dumps(value) if isinstance(value, dict) else str(value)]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of each part of EngineConfig, with its default and its docstring as help."""
    for part_name, part in PARTS.items():
        add_config_flags(parser.add_argument_group(f"engine: {part_name}"), part)


def add_config_flags(group: argparse._ArgumentGroup, config: type) -> None:
    """One flag per field of a config dataclass: its type, its default, and the docstring under it as help."""
    hints = typing.get_type_hints(config)
    docs = _field_docs(config)
    for field in dataclasses.fields(config):
        flag = "--" + field.name.replace("_", "-")
        hint = hints[field.name]
        help_text = f"{docs.get(field.name, '')} (default: {field.default})"
        if hint is bool or hint == bool | None:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
        elif typing.get_origin(hint) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(hint), default=field.default, help=help_text)
        elif literal := next((a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal), None):
            group.add_argument(flag, choices=typing.get_args(literal), default=field.default, help=help_text)
        elif typing.get_origin(hint) is tuple:  # one or more values, repeatable: --api-key k1 k2 --api-key k3
            group.add_argument(flag, nargs="+", action="extend", default=[], help=help_text)
        else:
            kind = next((t for t in (int, float) if hint is t or t in typing.get_args(hint)), str)
            group.add_argument(flag, type=kind, default=field.default, help=help_text)


def config_from_args(config: type[T], args: argparse.Namespace) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    return config(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**{name: getattr(args, name) for name in EngineConfig.field_names()})


def _field_docs(part: type) -> dict[str, str]:
    """Reads the attribute docstrings under each field, so the help text lives in one place."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(part))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    docs = {}
    for node, following in itertools.pairwise(cls.body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
        ):
            docs[node.target.id] = str(following.value.value).strip()
    return docs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloom", description="An LLM inference engine with continuous batching.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate a reply to one prompt and print it")
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    sampling = generate.add_argument_group("sampling")
    for name, kind in SAMPLING_FLAGS.items():
        sampling.add_argument(
            "--" + name.replace("_", "-"), dest=f"sp_{name}", metavar=name.upper(), type=kind, default=None
        )
    add_engine_flags(generate)

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model to serve, as `vllm serve MODEL`"
    )
    serve.add_argument("--config", metavar="FILE", help="a YAML file of flags (names with - or _) and their values, "
                       "as vLLM's; a flag the command line also gives takes the command line's value")  # fmt: skip
    add_config_flags(serve.add_argument_group("server"), ServerConfig)
    add_engine_flags(serve)
    accepted = serve.add_argument_group("vLLM's flags that change nothing here")
    for flag, why in VLLM_FLAGS_ACCEPTED.items():
        accepted.add_argument(flag, action="store_true", help=f"accepted: {why}")
    for flag, choices in VLLM_CHOICES_ACCEPTED.items():
        accepted.add_argument(flag, choices=choices, help=f"accepted: {BOTH_SERVED}")

    from tokenloom.advisor.diagnose import add_diagnose_command
    from tokenloom.advisor.plan import add_plan_command
    from tokenloom.bench.commands import add_bench_commands
    from tokenloom.bench.simulate_command import add_simulate_command

    add_bench_commands(commands)
    add_engine_flags(add_simulate_command(commands))
    add_plan_command(commands)
    add_diagnose_command(commands)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from tokenloom import LLM, SamplingParams

    overrides = {
        name: getattr(args, f"sp_{name}") for name in SAMPLING_FLAGS if getattr(args, f"sp_{name}") is not None
    }
    overrides.setdefault("max_tokens", 256)
    overrides.setdefault("temperature", 0.0)
    params = SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos, **overrides)
    config = engine_config_from_args(args)
    llm = LLM(**config.to_dict())
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": args.prompt}]], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """One server in this process, or N replicas behind Ray Serve's proxy (`--ray`)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    server, engine = config_from_args(ServerConfig, args), engine_config_from_args(args)
    if server.ray:
        from tokenloom.replicas.ray_serve import serve_on_ray
        from tokenloom.server.launch import configure_logging

        configure_logging(server)
        return serve_on_ray(server, engine)
    from tokenloom.server.launch import serve

    return serve(server, engine)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    try:
        given = expand_config_file(given, parser)
    except (ValueError, OSError) as error:
        print(f"tokenloom: error: {error}", file=sys.stderr)
        return 2
    if given[:1] == ["serve"] and (refused := refused_vllm_flag(given)) is not None:
        print(f"tokenloom: error: {refused}", file=sys.stderr)
        return 2
    args = parser.parse_args(given)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "diagnose":
            from tokenloom.advisor.diagnose import run_diagnose

            return run_diagnose(args)
        if args.command == "plan" and args.trace is not None:
            from tokenloom.advisor.capacity import run_capacity_plan

            return run_capacity_plan(args)
        if args.command == "plan":
            from tokenloom.advisor.plan import run_plan

            return run_plan(args)
        if args.command == "simulate":
            from tokenloom.bench.simulate_command import run_simulate

            return run_simulate(args, engine_config_from_args(args))
        if args.command == "bench":
            from tokenloom.bench.commands import run_bench

            return run_bench(args)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"tokenloom: error: {error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
