"""The `inferops` command line.

Each subcommand lives in the module that owns the work and exposes two functions:
`add_arguments(parser)` and `main(args) -> int`. Modules are imported only when their
subcommand runs, so `inferops serve` never pays for Django and `inferops run` never pays
for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("project.launcher", "start the whole platform (web, gateway, worker, beat, demo) on embedded defaults"),
    "serve": ("runtime.engine.server", "serve a local HF checkpoint with the built-in engine"),
    "demo-model": ("runtime.engine.demo_model", "write a small deterministic demo checkpoint"),
    "bench": ("project.bench_cli", "load-test any OpenAI-compatible endpoint; --rates measures a goodput curve"),
    "gateway": ("runtime.gateway.server", "the API gateway: keys, rate limits, routing, usage events"),
    "rollout": ("project.rollout_cli", "start a progressive rollout through the REST API and follow it (for CI)"),
    "eval": ("project.eval_cli", "score a deployment or a model version on an eval set through the REST API (for CI)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferops", description="SLO-first LLM inference platform")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen subcommand's module is imported to register its options.
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    return int(args._module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
