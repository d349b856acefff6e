"""Engine arguments: validated against what each backend accepts, and turned into a command line.

`engine_args` are the replica's command-line options in snake case (`{"max_num_seqs": 64}` ->
`--max-num-seqs 64`). For the built-in engine the accepted set is read from `inferops serve`'s
own argument parser, so the two can never disagree. For vLLM it is the subset of its server's
options that inferops knows how to run and bill for.
"""

from __future__ import annotations

import argparse
from functools import cache

# Set by the driver from the deployment itself; an engine_args value would fight it.
MANAGED_BY_INFEROPS = {"model", "host", "port", "served_model_name", "admin_token"}

# vLLM OpenAI server options inferops accepts: name -> type (bool = flag).
VLLM_ARGS: dict[str, type] = {
    "dtype": str, "max_model_len": int, "max_num_seqs": int, "max_num_batched_tokens": int,
    "gpu_memory_utilization": float, "tensor_parallel_size": int, "pipeline_parallel_size": int,
    "block_size": int, "kv_cache_dtype": str, "quantization": str, "enforce_eager": bool,
    "enable_prefix_caching": bool, "enable_chunked_prefill": bool, "seed": int, "swap_space": float,
    "max_logprobs": int, "trust_remote_code": bool, "revision": str, "tokenizer": str,
    "disable_log_requests": bool, "disable_log_stats": bool, "generation_config": str,
}
VLLM_CHOICES = {"dtype": {"auto", "float32", "float16", "bfloat16", "half", "float"}}


class EngineArgsError(ValueError):
    """`errors` maps each offending key to its reason."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{key}: {reason}" for key, reason in errors.items()))
        self.errors = errors


def to_flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def to_argv(engine_args: dict) -> list[str]:
    """`{"max_num_seqs": 8, "enforce_eager": True}` -> `["--max-num-seqs", "8", "--enforce-eager"]`.

    False flags are left out; lists become comma-separated values.
    """
    argv: list[str] = []
    for key, value in engine_args.items():
        if value is False or value is None:
            continue
        if value is True:
            argv.append(to_flag(key))
        elif isinstance(value, list | tuple):
            argv += [to_flag(key), ",".join(str(item) for item in value)]
        else:
            argv += [to_flag(key), str(value)]
    return argv


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


@cache
def builtin_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.Action]]:
    from runtime.engine.server import add_arguments

    parser = _RaisingParser(prog="inferops serve", add_help=False)
    add_arguments(parser)
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    return parser, actions


def _validate_builtin(engine_args: dict) -> dict[str, str]:
    parser, actions = builtin_parser()
    errors: dict[str, str] = {}
    for key, value in engine_args.items():
        action = actions.get(key)
        if action is None:
            errors[key] = "not an option of the built-in engine (see `inferops serve --help`)"
            continue
        is_flag = isinstance(action, argparse._StoreTrueAction)
        if is_flag and not isinstance(value, bool):
            errors[key] = "must be true or false"
            continue
        if not is_flag and (isinstance(value, bool | dict) or value is None):
            errors[key] = "must be a number or a string"
            continue
        try:
            parser.parse_args(["--model", "/validate-only", *to_argv({key: value})])
        except ValueError as exc:
            errors[key] = str(exc).replace(to_flag(key), key)
    return errors


def _validate_vllm(engine_args: dict) -> dict[str, str]:
    errors: dict[str, str] = {}
    for key, value in engine_args.items():
        expected = VLLM_ARGS.get(key)
        if expected is None:
            errors[key] = f"not a vLLM option inferops accepts; accepted: {', '.join(sorted(VLLM_ARGS))}"
        elif expected is bool and not isinstance(value, bool):
            errors[key] = "must be true or false"
        elif expected is int and (isinstance(value, bool) or not isinstance(value, int)):
            errors[key] = "must be an integer"
        elif expected is float and (isinstance(value, bool) or not isinstance(value, int | float)):
            errors[key] = "must be a number"
        elif expected is str and not isinstance(value, str):
            errors[key] = "must be a string"
        elif key in VLLM_CHOICES and value not in VLLM_CHOICES[key]:
            errors[key] = f"must be one of {', '.join(sorted(VLLM_CHOICES[key]))}"
    return errors


def validate(backend: str, engine_args) -> dict:
    """Return engine_args unchanged if every key is valid for backend; raise EngineArgsError."""
    if not isinstance(engine_args, dict):
        raise EngineArgsError({"engine_args": "must be an object of option: value"})
    errors = {key: "set by inferops from the deployment; remove it" for key in engine_args
              if key in MANAGED_BY_INFEROPS}
    remaining = {k: v for k, v in engine_args.items() if k not in MANAGED_BY_INFEROPS}
    errors |= _validate_builtin(remaining) if backend == "builtin" else _validate_vllm(remaining)
    if errors:
        raise EngineArgsError(errors)
    return engine_args
