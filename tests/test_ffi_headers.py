"""The XLA FFI headers the native handlers are built against (ffi/third_party/xla, so that the build
downloads no jaxlib): the oldest supported jaxlib's, since XLA registers a handler built against
older FFI headers than its own and refuses one built against newer ones."""

import importlib.metadata
import pathlib
import re
import tomllib

import jax

ROOT = pathlib.Path(__file__).parent.parent
VENDORED = ROOT / "ffi" / "third_party" / "xla"
HEADERS = ("xla/ffi/api/api.h", "xla/ffi/api/c_api.h", "xla/ffi/api/ffi.h")


def _ffi_api_version(include_dir: pathlib.Path) -> tuple[int, int]:
    """(major, minor) of the XLA FFI API that the headers in ``include_dir`` declare."""
    text = (include_dir / "xla" / "ffi" / "api" / "c_api.h").read_text()
    return tuple(
        int(re.search(rf"#define XLA_FFI_API_{part} (\d+)", text)[1]) for part in ("MAJOR", "MINOR")
    )


def _oldest_supported_jaxlib() -> tuple[int, int]:
    """(major, minor) of pyproject.toml's lower bound on jaxlib."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bound = next(re.search(r">=(\d+)\.(\d+)", d) for d in dependencies if d.startswith("jaxlib"))
    return int(bound[1]), int(bound[2])


def test_vendored_ffi_headers_are_the_oldest_supported_jaxlibs():
    """No newer than the installed jaxlib's; the same files where it is the oldest supported."""
    installed = pathlib.Path(jax.ffi.include_dir())
    assert _ffi_api_version(VENDORED) <= _ffi_api_version(installed)
    version = importlib.metadata.version("jaxlib")
    if tuple(int(part) for part in version.split(".")[:2]) == _oldest_supported_jaxlib():
        for header in HEADERS:
            assert (VENDORED / header).read_bytes() == (installed / header).read_bytes(), (
                f"ffi/third_party/xla/{header} differs from jaxlib {version}'s"
            )
