"""Test setup: 8 simulated CPU devices, forced before jax is imported anywhere; JAX's persistent
compilation cache, shared by the test processes and the program runs they start; the number of
parallel test processes; the rule for tests that need the real expert-load traces; the option of
the suite's two parts (``--suite``); the closing summary of the slowest test files, with the
seconds JAX spent tracing, lowering and compiling in each; and the standard meshes as fixtures
(built by tests/helpers.py, which module-level code uses directly)."""

import collections
import importlib.metadata
import os
import pathlib

import pytest

from tests.xla_settings import fast_compile_flags

_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = f"{_flags} {fast_compile_flags()}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: Where compiled programs are kept between tests, test processes and runs. The suite compiles the
#: same programs many times over (the same layer in several tests, the same training step in every
#: run of `experiments.train` a test starts), and on 2 cores compiling is most of its time. An entry
#: is keyed by the whole program, the compile options, the XLA flags and the jax version, so a hit
#: is the program that would have been compiled. The environment carries the settings to the
#: subprocesses (an environment variable set by the caller wins; JAX_ENABLE_COMPILATION_CACHE=false
#: turns it off). One folder per jaxlib version: no entry of one serves another, and each write
#: reads the folder's whole index (below).
COMPILATION_CACHE = (
    pathlib.Path(__file__).resolve().parents[1]
    / ".pytest_cache"
    / "jax-cache"
    / f"jaxlib-{importlib.metadata.version('jaxlib')}"
)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(COMPILATION_CACHE))
# Only programs that took at least this long to compile are kept: the layers, the training and
# serving steps, the portable planner. The thousands of small ones (eager operations, the native
# planner's call: 10-100 ms) compile again faster than the cache keeps them, since with a bound
# (below) each write reads the whole folder's index, so its cost grows with the entries (JAX's
# LRUCache: 18 ms per write at 1,000 entries, 66 ms at 3,000, about what a line's run wrote).
COMPILE_SECONDS_KEPT = 0.2
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(COMPILE_SECONDS_KEPT))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# A bound (least recently used entries go first) also makes JAX lock the folder around each read
# and write, so that parallel test processes never read an entry while another writes it.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))

#: Test processes for `-n auto` (pytest-xdist): one per core, at most 4 (each holds 8 simulated
#: devices and compiles on one core; more than 4 gain little and cost memory).
MAX_WORKERS = 4

#: Set (to anything but "" or "0") where the trace tests must run: CI sets it in ``.ci/run``.
REQUIRE_TRACES_ENV = "ULTRAEP_REQUIRE_TRACES"


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: the cores this process may use, capped at `MAX_WORKERS`."""
    del config
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def traces_required() -> bool:
    """Whether missing traces fail the trace tests instead of skipping them."""
    return os.environ.get(REQUIRE_TRACES_ENV, "") not in ("", "0")


def skip_without_traces(reason: str):
    """Skips the calling test because the traces are missing, or fails it when
    ``ULTRAEP_REQUIRE_TRACES`` is set (so that CI cannot pass with the trace tests skipped)."""
    if traces_required():
        pytest.fail(f"{reason} ({REQUIRE_TRACES_ENV} is set, so this fails instead of skipping)")
    pytest.skip(reason)


#: The option that splits the suite in two: ``--suite=quick`` is README.md's test command (and CI's
#: second JAX line's), ``--suite=rest`` what it leaves out; CI's first line runs both.
SUITE = "--suite"
SUITES = ("all", "quick", "rest")


def pytest_addoption(parser):
    parser.addoption(
        SUITE,
        choices=SUITES,
        default="all",
        help="all (default): every test; quick: the tests not marked slow (those marked "
        "gpu_compile too), of each parametrized one only its first case (every case of those "
        "marked every_case); rest: every test quick leaves out. -m applies first.",
    )


def in_quick_suite(items) -> list[bool]:
    """Whether each of ``items`` (in collection order) is in ``--suite=quick``: not marked slow
    unless marked gpu_compile; and unparametrized, marked every_case, or its test's first case of
    those left (every case of what a JAX version compiles differently: collectives' types, the
    ragged exchange, plans that differ between groups, exports, the GPU compile; and of the
    documents' programs, which users copy onto whichever JAX they have)."""
    seen, quick = set(), []
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("gpu_compile"):
            quick.append(False)
        elif getattr(item, "callspec", None) is None or item.get_closest_marker("every_case"):
            quick.append(True)
        else:
            name = (item.nodeid.split("::")[0], getattr(item, "cls", None), item.originalname)
            quick.append(name not in seen)
            seen.add(name)
    return quick


@pytest.hookimpl(trylast=True)  # after -m has deselected: the first case that would run
def pytest_collection_modifyitems(config, items):
    """``--suite=quick`` or ``rest``: deselects what the other one runs (`in_quick_suite`)."""
    suite = config.getoption(SUITE)
    if suite == "all":
        return
    keep = in_quick_suite(items) if suite == "quick" else [not q for q in in_quick_suite(items)]
    kept = [item for item, k in zip(items, keep, strict=True) if k]
    dropped = [item for item, k in zip(items, keep, strict=True) if not k]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


#: Seconds each test file took (setup, call and teardown of its tests, summed), for the summary.
_FILE_SECONDS: collections.Counter = collections.Counter()
#: How many of the slowest files the summary names.
SLOWEST_FILES = 10
#: JAX's compile stages, by the name of the duration event JAX records for each
#: (`jax.monitoring`), and the word the summary gives it.
JAX_STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "traced",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowered",
    "/jax/core/compile/backend_compile_duration": "compiled",
}
#: Seconds of each stage in this test process since the current test's setup began.
_JAX_SECONDS: collections.Counter = collections.Counter()
#: Each test file's seconds of each stage (its tests' own, not the programs they start).
_FILE_JAX_SECONDS: collections.defaultdict = collections.defaultdict(collections.Counter)
#: Whether this process's listener (`_count_jax_stage`) is registered.
_listening = False
#: The key of a test report's user property that carries its test's `_JAX_SECONDS`.
JAX_SECONDS_PROPERTY = "jax_compile_seconds"


def _count_jax_stage(event: str, duration: float, **kwargs) -> None:
    """A `jax.monitoring` listener: adds a compile stage's seconds to the current test's."""
    del kwargs
    if event in JAX_STAGES:
        _JAX_SECONDS[JAX_STAGES[event]] += duration


def pytest_runtest_setup(item):
    """Starts the test's count of JAX's compile stages (the listener registered once, in the
    process that runs tests, which imports JAX anyway)."""
    del item
    global _listening
    if not _listening:
        from jax import monitoring  # after the settings above

        monitoring.register_event_duration_secs_listener(_count_jax_stage)
        _listening = True
    _JAX_SECONDS.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Hands the test's compile stages to the process that prints the summary, on the report of
    its teardown (a test process's reports reach it with their user properties)."""
    del item
    report = yield
    if call.when == "teardown" and _JAX_SECONDS:
        report.user_properties.append((JAX_SECONDS_PROPERTY, dict(_JAX_SECONDS)))
    return report


def pytest_runtest_logreport(report):
    """Adds a test phase's seconds, and its test's compile stages, to its file's (in the process
    that prints the summary, the test processes' reports included)."""
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] += report.duration
    for key, seconds in report.user_properties:
        if key == JAX_SECONDS_PROPERTY:
            _FILE_JAX_SECONDS[path].update(seconds)


def _stages(seconds: collections.Counter) -> str:
    """``"JAX traced 1.0 s, lowered 0.5, compiled 2.0"`` (the stages in `JAX_STAGES`' order)."""
    words = [f"{word} {seconds[word]:.1f}" for word in JAX_STAGES.values()]
    return "JAX " + words[0] + " s, " + ", ".join(words[1:])


def pytest_terminal_summary(terminalreporter):
    """Ends the run with its slowest test files, each with the seconds of its tests that JAX
    spent tracing, lowering and compiling (XLA) programs, so a regression in the suite's time
    shows where it starts, and whether it is compiling."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    all_files = sum(_FILE_JAX_SECONDS.values(), collections.Counter())
    title = f"{SLOWEST_FILES} slowest test files (of {total:.0f} s in test processes"
    terminalreporter.write_sep("=", f"{title}; {_stages(all_files)})")
    for path, seconds in _FILE_SECONDS.most_common(SLOWEST_FILES):
        line = f"{seconds:8.1f} s  {path}"
        if _FILE_JAX_SECONDS[path]:  # a file whose tests compiled nothing shows no stages
            line += f"  ({_stages(_FILE_JAX_SECONDS[path])})"
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def ep8_mesh():
    """8 EP ranks: (8,) ("expert",) (`helpers.make_mesh("ep8")`)."""
    from tests.helpers import make_mesh  # imports jax: after the settings above

    return make_mesh("ep8")


@pytest.fixture(scope="session")
def dp2ep4_mesh():
    """2 data groups of 4 EP ranks: (2, 4) ("data", "expert") (`helpers.make_mesh("dp2ep4")`)."""
    from tests.helpers import make_mesh

    return make_mesh("dp2ep4")


@pytest.fixture
def mesh(request):
    """The standard mesh of the kind a test parametrises indirectly: ``@pytest.mark.parametrize(
    "mesh", ["ep8", "dp2ep4"], indirect=True)``."""
    from tests.helpers import make_mesh

    return make_mesh(request.param)
