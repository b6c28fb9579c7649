"""The documentation against the code it describes: the PYCOMM_* knobs in
docs/configuration.md against pycomm/config.py and setup.py, the public API's
docstrings (the site's API reference is built from them), and the README's limits."""
import ast
import importlib
import inspect
import os
import re

import pytest

from pycomm import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOB = re.compile(r"PYCOMM_[A-Z0-9_]+")
# The modules the API reference (docs/api/) renders.
API_MODULES = ("pycomm", "pycomm.hooks", "pycomm.compression", "pycomm.train", "pycomm.bench")


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as handle:
        return handle.read()


def _table_knobs(markdown: str, heading: str) -> list:
    """The variables in the first column of the table under `## heading`."""
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert section, f"docs/configuration.md has no '## {heading}' section"
    names = []
    for line in section.group(1).splitlines():
        cell = re.match(r"\|\s*`(PYCOMM_[A-Z0-9_]+)`\s*\|", line)
        if cell:
            names.append(cell.group(1))
    return names


def _string_knobs(source: str) -> set:
    """PYCOMM_* names that appear as whole string constants in Python code (not in
    docstrings or comments): what the code reads."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and KNOB.fullmatch(node.value):
            found.add(node.value)
    return found


def test_runtime_knobs_documented_once_and_exactly():
    documented = _table_knobs(_read("docs", "configuration.md"), "Runtime")
    assert len(documented) == len(set(documented)), f"a knob is listed twice: {documented}"
    assert set(documented) == set(config.ENV_VARS), (
        f"docs/configuration.md 'Runtime' and pycomm.config.ENV_VARS differ: "
        f"undocumented {sorted(set(config.ENV_VARS) - set(documented))}, "
        f"documented but not in config.py {sorted(set(documented) - set(config.ENV_VARS))}")


def test_config_reads_only_declared_knobs():
    # A knob read by name in config.py but missing from ENV_VARS would escape the check above.
    read = _string_knobs(_read("pycomm", "config.py"))
    assert read, "found no PYCOMM_* names in pycomm/config.py: has the way knobs are declared changed?"
    assert read <= set(config.ENV_VARS), f"config.py reads knobs not in ENV_VARS: {sorted(read - set(config.ENV_VARS))}"


def test_build_knobs_documented_exactly():
    documented = _table_knobs(_read("docs", "configuration.md"), "Build time")
    read = set(re.findall(r"environ\.get\(\s*\"(PYCOMM_[A-Z0-9_]+)\"", _read("setup.py")))
    assert read, "found no PYCOMM_* variable read by setup.py"
    assert set(documented) == read, (
        f"docs/configuration.md 'Build time' lists {sorted(documented)}, setup.py reads {sorted(read)}")


def test_no_other_page_keeps_an_environment_table():
    # The table lives in one place: another page (or the README) may name a knob, not tabulate them.
    row = re.compile(r"^\|\s*`PYCOMM_[A-Z0-9_]+`\s*\|", re.M)
    pages = [("README.md",)] + [("docs", name) for name in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                 if name.endswith(".md") and name != "configuration.md"]
    tabulated = [os.path.join(*page) for page in pages if len(row.findall(_read(*page))) > 1]
    assert not tabulated, f"environment tables outside docs/configuration.md: {tabulated}"


def _own_doc(obj) -> str:
    doc = obj.__doc__ or ""
    if inspect.isclass(obj) and doc.startswith(obj.__name__ + "("):
        return ""  # the signature a dataclass writes when the class has no docstring
    return doc.strip()


@pytest.mark.parametrize("module_name", API_MODULES)
def test_public_api_has_docstrings(module_name):
    module = importlib.import_module(module_name)
    assert _own_doc(module), f"{module_name} has no module docstring"
    missing = [name for name in module.__all__
               if (inspect.isclass(getattr(module, name)) or inspect.isroutine(getattr(module, name)))
               and not _own_doc(getattr(module, name))]
    assert not missing, f"{module_name}: public names without a docstring: {missing}"


def test_readme_is_an_entry_point():
    text = _read("README.md")
    assert len(text.splitlines()) <= 150, f"README.md has {len(text.splitlines())} lines (at most 150)"
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not dates, f"README.md carries dates: {dates}"
    hashes = [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", text)
              if re.search(r"[a-f]", word) and re.search(r"[0-9]", word)]
    assert not hashes, f"README.md carries commit hashes: {hashes}"
