"""The test lists of conftest.py (slow, serial, longest first) name modules and functions
that exist: a renamed test would otherwise drop out of a list silently (`make test-fast`
would grow, or a timing test would run beside another worker)."""
import ast
import glob
import os

import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))


def _modules() -> dict:
    return {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True)}


def test_slow_lists_name_existing_tests():
    """The slow, serial and longest-first lists: a name that matches nothing would leave a
    test on the parallel workers or out of `make test-fast`'s cut without a word."""
    modules = _modules()
    missing = sorted(m for m in conftest.SLOW_MODULES | conftest.SERIAL_MODULES | set(conftest.LONGEST_FIRST)
                     if m not in modules)
    for entry in conftest.SLOW_TESTS | conftest.SERIAL_TESTS:
        module, _, function = entry.partition("::")
        if module not in modules:
            missing.append(entry)
            continue
        with open(modules[module]) as f:
            tree = ast.parse(f.read())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if function not in names:
            missing.append(entry)
    assert not missing, f"conftest.py's slow lists name tests that do not exist: {missing}"


def test_module_basenames_are_unique():
    """pytest imports test files by basename (no __init__.py in the layer folders)."""
    paths = glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True)
    names = [os.path.basename(p) for p in paths if "integrations" not in p.split(os.sep)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
