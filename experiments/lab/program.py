"""The programs' command-line conventions: `run_main` (absl's ``app.run`` with `parse_flags`:
one-line flag errors, a short ``--help``), `fail` (any other unusable input: one line, exit 2)
and `fallback_note` (the note when balanced layers fall back to plain EP). Their flags are made
in `experiments.lab.cli`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

_HELP_ARGS = ("--help", "-help", "--helpshort", "-helpshort", "-?")


def short_help() -> str:
    """What ``--help`` prints: the program's module doc (its usage line and examples), then the
    flags of the program with their help, without absl's header naming the module's file."""
    from absl import flags

    doc = (sys.modules["__main__"].__doc__ or "").strip()
    # absl's listing opens with the file path of the module that defines the flags.
    listing = [line for line in flags.FLAGS.main_module_help().splitlines() if line[:1].isspace()]
    return f"{doc}\n\nflags:\n" + "\n".join(listing) + "\n\n--helpfull lists every flag.\n"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with the experiments' conventions: a flag that cannot be parsed ends
    with one line ``error: ...`` (exit code 2, as for any other unusable flag); ``--help`` or
    ``--helpshort`` print `short_help` and ``--helpfull`` absl's full help, and exit 0 (absl
    exits 1)."""
    from absl import flags

    args = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    if any(arg in _HELP_ARGS for arg in args):
        sys.stdout.write(short_help())
        sys.exit(0)
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(2)
    except SystemExit as stop:
        # While parsing, only absl's help flags exit, with 1, after printing the help.
        if stop.code == 1:
            sys.exit(0)
        raise


#: JAX's logger that reports, at INFO, each backend it tried and skipped quietly (on a CPU
#: machine: "Unable to initialize backend 'tpu': ... libtpu.so ..."). Python's own logging shows
#: only warnings, but absl's handler, which `absl.app.run` installs, shows INFO (``--verbosity``
#: defaults to 0), so that line opened the output of every program. A backend that is asked
#: for (``JAX_PLATFORMS``) and fails still raises.
_BACKEND_PROBE_LOGGER = "jax._src.xla_bridge"


def run_main(main: Callable[[list[str]], object]) -> None:
    """``absl.app.run(main)`` with `parse_flags`, without JAX's INFO lines about the backends it
    probed and skipped (`_BACKEND_PROBE_LOGGER`)."""
    import logging

    from absl import app

    logging.getLogger(_BACKEND_PROBE_LOGGER).setLevel(logging.WARNING)
    app.run(main, flags_parser=parse_flags)


def fail(message) -> None:
    """Ends the program with one line ``error: <message>`` on stderr and exit code 2, as for an
    unusable flag (`parse_flags`)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def fallback_note(tokens_per_rank: int, threshold: int, subject: str) -> str:
    """The programs' note when their balanced layers fall back to plain EP: ``tokens_per_rank``
    below ``threshold`` (``--min_tokens_per_rank``); "" otherwise. ``subject`` names what runs
    plain EP, with its verb ("the MoE layers run")."""
    if tokens_per_rank >= threshold:
        return ""
    return (
        f"note: {tokens_per_rank} tokens per rank is below --min_tokens_per_rank={threshold}: "
        f"{subject} plain expert parallelism with a buffer for every pair (nothing dropped); "
        f"--min_tokens_per_rank=0 balances anyway"
    )
