"""`make mutation`'s per-module test lists (pyproject's [tool.vitserve.mutation-tests], read by
tests/conftest.py): every module listed is one mutmut mutates, every test path exists and is in
[tool.mutmut]'s selection (a path outside it would be collected by no mutation run), and the patterns
of `MUTATE=` pick the lists of the modules they match."""

from __future__ import annotations

import tomllib

from tests.conftest import mutation_tests
from tests.support import REPO


def test_each_modules_tests_exist_and_are_in_the_mutation_selection():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["tool"]
    selection = tool["mutmut"]["pytest_add_cli_args_test_selection"]
    for module, tests in tool["vitserve"]["mutation-tests"].items():
        assert module in tool["mutmut"]["only_mutate"], module
        for test in tests:
            assert (REPO / test.split("::")[0]).is_file(), test
            assert any(
                test.startswith(chosen) or chosen.startswith(test) for chosen in selection
            ), test


def test_mutate_patterns_pick_their_modules_lists():
    assert mutation_tests("") is None
    assert mutation_tests("service.link.arena*") == ("tests/service/test_arena.py",)
    arena_and_codec = mutation_tests("service.link.arena* service.frontend.oip.grpc_codec*")
    assert arena_and_codec == (
        "tests/service/test_arena.py",
        "tests/service/test_codec_bytes.py",
        "tests/service/test_codec_validation.py",
    )
    # a mutant name rerun on its own picks its module's list
    assert mutation_tests("service.link.arena.xǁArenaǁput__mutmut_11") == (
        "tests/service/test_arena.py",
    )
    assert mutation_tests("export.onnx*") is None  # no list: the whole selection
