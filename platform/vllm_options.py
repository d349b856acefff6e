"""Regenerate deployments/vllm_options.json from the argument parser of an installed vLLM.

inferops validates a `backend: vllm` deployment's engine_args against this file, so the accepted
options are exactly those of the vLLM the replicas run. Run it with the Python that has vLLM
(`make vllm` creates one) after changing vLLM's version:

    .venv-vllm/bin/python platform/vllm_options.py            # rewrite the file
    .venv-vllm/bin/python platform/vllm_options.py --check    # exit 1 if the file is stale

It needs only vLLM itself, never the project's packages (vLLM's pins conflict with them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "deployments" / "vllm_options.json"
# Options of the server process that are not engine settings a deployment may choose.
SKIPPED = {"help", "version"}


def server_parser() -> argparse.ArgumentParser:
    """The parser of `vllm serve` / the OpenAI API server: engine and front-end options alike."""
    try:  # where newer vLLM keeps it
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # before vLLM 0.32
        from vllm.entrypoints.openai.cli_args import make_arg_parser

    return make_arg_parser(FlexibleArgumentParser())


def type_name(kind) -> str | None:
    """int, float, str, json or human_int: what a deployment's engine_args value must be.

    vLLM wraps types in small parsers (optional_type(int), human_readable_int, parse_type(json.loads),
    parse_dataclass for its config objects): they are read by name and through their closures, and
    a wrapper this does not know yet falls back to "str" rather than failing.
    """
    if kind is None:
        return "str"
    if kind in (int, float, str):
        return kind.__name__
    name = getattr(kind, "__name__", "")
    if kind is json.loads or name in ("loads", "parse_dataclass", "union_dict_and_str"):
        return "json"
    if name.startswith("human_readable_int"):
        return "human_int"  # 4096, or text vLLM reads: "4k", "1M" (and "auto" where it says so)
    for cell in getattr(kind, "__closure__", None) or ():
        inner = cell.cell_contents
        if callable(inner) and inner is not kind and (found := type_name(inner)) is not None:
            return found
    return None


def describe(action: argparse.Action) -> tuple[str, dict] | None:
    long_flags = [flag for flag in action.option_strings if flag.startswith("--") and not flag.startswith("--no-")]
    if not long_flags or action.dest in SKIPPED or action.help == argparse.SUPPRESS:
        return None
    flag = long_flags[0]
    key = flag[2:].replace("-", "_")
    if isinstance(action, argparse.BooleanOptionalAction):
        return key, {"type": "bool", "negatable": True}
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return key, {"type": "bool", "negatable": False}
    if isinstance(action, argparse._StoreConstAction | argparse._CountAction | argparse._AppendConstAction):
        return None  # no value to give: nothing a deployment could set through engine_args
    option: dict = {"type": type_name(action.type) or "str"}
    if action.choices is not None:
        option["choices"] = sorted(str(choice) for choice in action.choices)
    if action.nargs in ("+", "*") or isinstance(action.nargs, int) and action.nargs > 1:
        option["many"] = True
    return key, option


def options(parser: argparse.ArgumentParser) -> dict[str, dict]:
    described = (describe(action) for action in parser._actions)
    return dict(sorted(item for item in described if item is not None))


def build() -> dict:
    import vllm

    return {"vllm_version": vllm.__version__, "options": options(server_parser())}


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--check", action="store_true", help="exit 1 if the checked-in file differs")
    cli.add_argument("--output", type=Path, default=OUTPUT)
    args = cli.parse_args()
    text = json.dumps(build(), indent=1, sort_keys=True) + "\n"
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: rerun {sys.argv[0]} without --check", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}: {len(json.loads(text)['options'])} options of vLLM {json.loads(text)['vllm_version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
