"""The suite's test processes share what a file builds once (a trained run, compiled layer cases)
through pytest-xdist's groups (`--dist loadgroup`, pyproject.toml): a group's tests run in one
process. A pytest that xdist cannot group (pytest 9.2 with xdist 3.8) spreads them over every
process instead, each building it all again, and nothing fails: this test does."""

import os

import pytest


@pytest.mark.xdist_group("test_xdist_groups")
def test_grouped_tests_run_as_one_group(request):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("one test process (-n 0): no groups to keep")
    assert request.config.getvalue("loadgroup"), "the test processes run without --dist loadgroup"
    # pytest-xdist sends a group's tests to one process by the group's name in their ids.
    assert request.node.nodeid.endswith("@test_xdist_groups"), (
        f"pytest-xdist did not group this test ({request.node.nodeid}): this pytest and "
        "pytest-xdist do not work together (see the test extra in pyproject.toml)"
    )
