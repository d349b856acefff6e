"""The settings page's Configuration table and the environment variables the code reads agree (issues 35, 37).

The code is every .py file of the repository outside tests/, bench/ (benchmark harnesses, whose
variables are their own) and hidden folders (.venv, .venv-vllm, .git...). It is parsed, not run:
a read is `os.environ[NAME]`, `os.environ.get(NAME)`, `os.getenv(NAME)`, `NAME in os.environ`, or a
call with NAME first to a function that reads the variable its first parameter names (the
`env_*` helpers of inferops/env.py, found by that shape, so a new helper counts too). NAME may be
a string literal, a name bound to one, or an f-string of a family listed in FAMILIES; a read this
cannot name fails the test, so no variable slips past it. `os.environ.setdefault` is not counted:
it hands a default to child processes.

To document a new variable, add a row to the table under "## Configuration" in docs/settings.md:
| `INFEROPS_SOMETHING` | its default | what it changes |
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_PAGE = ROOT / "docs" / "settings.md"
SKIPPED_TOP_LEVEL = {"tests", "bench"}
VARIABLE = re.compile(r"[A-Z][A-Z0-9_]*")
READ_METHODS = {"get", "pop"}


def _kubernetes_variables() -> list[str]:
    from deployments.replicas.drivers.kubernetes import KubernetesSettings

    return [f"INFEROPS_K8S_{name.upper()}" for name in KubernetesSettings.__dataclass_fields__]


# Reads whose name is built at run time: the f-string's literal prefix -> every name it can take.
FAMILIES: dict[str, Callable[[], list[str]]] = {"INFEROPS_K8S_": _kubernetes_variables}


@dataclass(frozen=True)
class Read:
    name: str  # a variable, or an f-string's literal prefix when `family`
    where: str  # path:line
    family: bool = False


def code_files(root: Path = ROOT) -> Iterator[Path]:
    for directory, subdirectories, files in os.walk(root):
        # Pruned, not filtered: the virtualenvs alone hold tens of thousands of files.
        subdirectories[:] = sorted(name for name in subdirectories if not name.startswith(".")
                                   and not (Path(directory) == root and name in SKIPPED_TOP_LEVEL))
        yield from (Path(directory) / name for name in sorted(files) if name.endswith(".py"))


def _is_environ(node: ast.AST, aliases: set[str]) -> bool:
    """os.environ, or `environ` imported from os."""
    if isinstance(node, ast.Attribute) and node.attr == "environ":
        return isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id in aliases


def _is_getenv(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "getenv":
        return isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id in aliases


def _called_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


class ModuleScan:
    """The reads in one module. `helpers`: names of functions that read the variable their first
    parameter names (their own reads are not reads of a particular variable)."""

    def __init__(self, source: str, label: str):
        self.tree = ast.parse(source)
        self.label = label
        self.environ_aliases = {a.asname or a.name for node in ast.walk(self.tree) if isinstance(node, ast.ImportFrom)
                                and node.module == "os" for a in node.names if a.name == "environ"}
        self.getenv_aliases = {a.asname or a.name for node in ast.walk(self.tree) if isinstance(node, ast.ImportFrom)
                               and node.module == "os" for a in node.names if a.name == "getenv"}
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(self.tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent

    def direct_reads(self) -> Iterator[tuple[ast.AST, ast.AST]]:
        """(key expression, the node reading it) for every direct read of the environment."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                    and _is_environ(node.value, self.environ_aliases):
                yield node.slice, node
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in READ_METHODS \
                        and _is_environ(func.value, self.environ_aliases):
                    yield node.args[0], node
                elif _is_getenv(func, self.getenv_aliases):
                    yield node.args[0], node
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In | ast.NotIn) \
                    and _is_environ(node.comparators[0], self.environ_aliases):
                yield node.left, node

    def enclosing_function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return node
        return None

    def all_reads(self, helpers: set[str]) -> Iterator[tuple[ast.AST, ast.AST]]:
        """(key expression, node) for direct reads and for calls to the helpers."""
        yield from self.direct_reads()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and _called_name(node.func) in helpers and node.args:
                yield node.args[0], node

    def passes_its_parameter(self, key: ast.AST, node: ast.AST) -> str | None:
        """The enclosing function's name when `key` is its first parameter (a helper's own read)."""
        function = self.enclosing_function(node)
        if function is not None and function.args.args and isinstance(key, ast.Name) \
                and key.id == function.args.args[0].arg:
            return function.name
        return None

    def helpers(self, known: set[str]) -> set[str]:
        """Functions that read (directly or through a known helper) the variable their first parameter names."""
        return {name for key, node in self.all_reads(known) if (name := self.passes_its_parameter(key, node))}

    def reads(self, helpers: set[str]) -> Iterator[Read | str]:
        """Each read, or a message saying where a read's variable cannot be named."""
        for key, node in self.all_reads(helpers):
            if self.passes_its_parameter(key, node) in helpers:
                continue  # inside a helper: its callers name the variable
            yield self.resolve(key, node)

    def resolve(self, key: ast.AST, node: ast.AST, depth: int = 0) -> Read | str:
        where = f"{self.label}:{node.lineno}"
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return Read(key.value, where)
        if isinstance(key, ast.JoinedStr) and key.values and isinstance(key.values[0], ast.Constant):
            return Read(key.values[0].value, where, family=True)
        if isinstance(key, ast.Name) and depth < 3:
            bound = self.binding(key.id, self.enclosing_function(node))
            if bound is not None:
                return self.resolve(bound, node, depth + 1)
        return (f"{where}: cannot tell which environment variable `{ast.unparse(key)}` names; use a literal "
                "name (or a family in FAMILIES of tests/test_settings_doc.py)")

    def binding(self, name: str, function) -> ast.AST | None:
        """The one expression `name` is assigned in the function (else at module level)."""
        for scope in ([function] if function is not None else []) + [self.tree]:
            values = []
            body = ast.walk(scope) if scope is function else scope.body
            for statement in body:
                if not isinstance(statement, ast.Assign):
                    continue
                for target in statement.targets:
                    if isinstance(target, ast.Name) and target.id == name:
                        values.append(statement.value)
                    elif isinstance(target, ast.Tuple) and isinstance(statement.value, ast.Tuple):
                        values += [value for element, value in zip(target.elts, statement.value.elts, strict=False)
                                   if isinstance(element, ast.Name) and element.id == name]
            if len(values) == 1:
                return values[0]
        return None


def scan(sources: dict[str, str]) -> tuple[dict[str, list[str]], list[str]]:
    """{variable: [where it is read]} and the reads that could not be named, for {label: source}."""
    # Only text that mentions the environment, or a helper by name, can read a variable: parsing
    # just those files keeps the scan well under a second.
    modules = {label: ModuleScan(source, label) for label, source in sources.items()
               if "environ" in source or "getenv" in source}
    helpers: set[str] = set()
    while True:  # helpers built on helpers, until no new one turns up
        found = set().union(*(module.helpers(helpers) for module in modules.values()))
        for label, source in sources.items():
            if label not in modules and any(helper in source for helper in found):
                modules[label] = ModuleScan(source, label)
        if found <= helpers:
            break
        helpers |= found
    variables: dict[str, list[str]] = {}
    unresolved = []
    for module in modules.values():
        for read in module.reads(helpers):
            if isinstance(read, str):
                unresolved.append(read)
                continue
            names = [read.name]
            if read.family:
                if read.name not in FAMILIES:
                    unresolved.append(f"{read.where}: an f-string name starting {read.name!r} is not a family in "
                                      "FAMILIES of tests/test_settings_doc.py")
                    continue
                names = FAMILIES[read.name]()
            for name in names:
                variables.setdefault(name, []).append(read.where)
    return variables, unresolved


def code_variables() -> tuple[dict[str, list[str]], list[str]]:
    return scan({str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in code_files()})


def documented_variables(page: str) -> dict[str, str]:
    """{variable: default} from the table under "## Configuration"; ValueError on a malformed row."""
    # The section runs to the next heading of its level, or to the end of the page.
    section = re.search(r"^## Configuration\n(.*?)(?=^## |\Z)", page, re.M | re.S)
    if section is None:
        raise ValueError("docs/settings.md has no '## Configuration' section")
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    if len(rows) < 3 or [cell.strip() for cell in rows[0].strip("|").split("|")] != ["variable", "default", "meaning"]:
        raise ValueError("the Configuration section has no table headed | variable | default | meaning |")
    documented: dict[str, str] = {}
    for row in rows[2:]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        match = VARIABLE.fullmatch(cells[0].strip("`")) if cells[0].startswith("`") and cells[0].endswith("`") else None
        if len(cells) != 3 or match is None or not cells[2]:
            raise ValueError(f"malformed row (want | `NAME` | default | meaning |): {row}")
        if match.group() in documented:
            raise ValueError(f"{match.group()} has two rows")
        documented[match.group()] = cells[1]
    return documented


def page_variables() -> dict[str, str]:
    return documented_variables(SETTINGS_PAGE.read_text(encoding="utf-8"))


def test_every_variable_the_code_reads_has_a_row_on_the_settings_page():
    variables, unresolved = code_variables()
    assert unresolved == []
    documented = page_variables()
    missing = {name: where for name, where in variables.items() if name not in documented}
    assert not missing, "read by the code but not in docs/settings.md's Configuration table (add a row per variable: " \
        "| `NAME` | default | meaning |):\n" + "\n".join(f"  {name} (read at {', '.join(where)})"
                                                          for name, where in sorted(missing.items()))


def test_every_row_of_the_settings_table_names_a_variable_the_code_reads():
    variables, _ = code_variables()
    stale = sorted(set(page_variables()) - set(variables))
    assert not stale, f"in docs/settings.md's Configuration table but read nowhere in the code (remove the rows): " \
        f"{stale}"


SAMPLE = '''
import os
from os import environ as env_map, getenv

KEY = "FROM_A_CONSTANT"


def env_text(name, default=""):
    return os.environ.get(name, default)


def env_flag(name):
    return env_text(name) == "1"


def read_all(flag):
    a = os.environ["SUBSCRIPTED"]
    b = os.environ.get("GOT", "x")
    c = getenv("GETENV_ALIAS")
    d = os.getenv("GETENV")
    e = "MEMBER" in os.environ
    f = env_map.get("ENVIRON_ALIAS")
    g = env_text("THROUGH_A_HELPER")
    g2 = env_flag("THROUGH_TWO_HELPERS")
    h = os.environ.get(KEY)
    key, default = f"INFEROPS_K8S_{flag.upper()}", None
    i = os.environ[key]
    os.environ.setdefault("SET_FOR_CHILDREN", "1")
    os.environ["WRITTEN"] = "1"
    j = dict(os.environ)
    k = process_environ.get("NOT_OURS")
'''


def test_the_scan_finds_every_form_of_read_and_only_reads():
    variables, unresolved = scan({"sample.py": SAMPLE})
    assert unresolved == []
    assert set(variables) == {"SUBSCRIPTED", "GOT", "GETENV_ALIAS", "GETENV", "MEMBER", "ENVIRON_ALIAS",
                              "THROUGH_A_HELPER", "THROUGH_TWO_HELPERS", "FROM_A_CONSTANT", *_kubernetes_variables()}
    assert variables["THROUGH_A_HELPER"] == ["sample.py:23"]


def test_every_read_of_a_module_is_seen_past_one_that_cannot_be_named():
    variables, unresolved = scan({"sample.py": "import os\na = os.environ[pick()]\nb = os.environ[other()]\n"
                                               "c = os.getenv('AFTER_THEM')\n"})
    assert [message.split(":")[:2] for message in unresolved] == [["sample.py", "2"], ["sample.py", "3"]]
    assert set(variables) == {"AFTER_THEM"}


@pytest.mark.parametrize("source", ["import os\nv = os.environ.get(pick())\n",
                                    "import os\nv = os.environ[f'OTHER_{x}']\n",
                                    "import os\ndef f(n):\n    n = n + '_X'\n    return os.environ[n + 'Y']\n"])
def test_a_read_the_scan_cannot_name_fails(source):
    _, unresolved = scan({"sample.py": source})
    assert len(unresolved) == 1 and unresolved[0].startswith("sample.py:"), unresolved


@pytest.mark.parametrize("table, error", [
    ("| variable | default | meaning |\n|---|---|---|\n| NAME | 1 | no backticks |\n", "malformed row"),
    ("| variable | default | meaning |\n|---|---|---|\n| `NAME` | 1 |  |\n", "malformed row"),
    ("| variable | default | meaning |\n|---|---|---|\n| `A` | 1 | a |\n| `A` | 2 | again |\n", "two rows"),
    ("| name | value |\n|---|---|\n| `A` | 1 |\n", "no table"),
])
def test_a_malformed_table_is_refused(table, error):
    with pytest.raises(ValueError, match=error):
        documented_variables(f"# x\n\n## Configuration\n\n{table}\n## Next\n")


def test_the_table_may_end_the_page():
    page = "# x\n\n## Configuration\n\n| variable | default | meaning |\n|---|---|---|\n| `A` | 1 | a |\n"
    assert documented_variables(page) == {"A": "1"}


def test_the_settings_table_reads_as_variables_and_defaults():
    documented = page_variables()
    assert documented["INFEROPS_DATA_DIR"] == "`.inferops`"
    assert documented["REDIS_URL"] == "embedded Redis"
