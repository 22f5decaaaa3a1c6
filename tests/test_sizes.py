"""The house's size rules, read from the source: no file in experiments/ over `MAX_FILE_LINES`
lines; no function in ultraep_jax/, ffi/ or experiments/ over `MAX_FUNCTION_LINES` lines of code
(Python by ast, its docstring not counted; C++ and CUDA by a scan of the braces)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def python_function_lines(source: str) -> dict[str, int]:
    """Each function's (methods and nested ones too) lines from ``def`` to its end, less its
    docstring's, by ``name@line``."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines -= first.end_lineno - first.lineno + 1
            out[f"{node.name}@{node.lineno}"] = lines
    return out


#: What the brace scan blanks: comments, string and character literals, preprocessor lines (with
#: their continuations).
_NOT_CODE = re.compile(
    r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|^[ \t]*#(?:[^\n]*\\\n)*[^\n]*",
    re.S | re.M,
)
_SCOPE = re.compile(r"^\s*(template\s*<[^{]*>\s*)?(namespace|extern|struct|class|union|enum)\b")


def cpp_function_lines(source: str) -> dict[str, int]:
    """Each function body's lines in C++ / CUDA ``source``, from the line its signature starts to
    its closing brace, by ``first words@line``: a ``{`` opened at namespace or type scope after a
    statement with a ``(`` opens a function (lambdas and methods too); comments, literals and
    preprocessor lines are blanked first (their newlines kept)."""
    text = _NOT_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), source)
    out, stack, statement, start, line = {}, [], "", None, 1
    for ch in text:
        if ch == "\n":
            line += 1
        if ch == "{":
            if "fn" in stack:
                stack.append("block")
            elif _SCOPE.match(statement) or "(" not in statement:
                stack.append("scope")
            else:
                stack.append("fn")
                start = (" ".join(statement.split()[:3]), line - statement.strip().count("\n"))
            statement = ""
        elif ch == "}":
            if stack.pop() == "fn":
                name, begin = start
                out[f"{name}@{begin}"] = line - begin + 1
            statement = ""
        elif ch == ";":
            statement = ""
        else:
            statement += ch
    return out


def test_the_scans_count_what_they_should():
    py = 'def f(x):\n    """Doc.\n\n    More."""\n    y = x\n    return y\n'
    assert python_function_lines(py) == {"f@1": 3}
    cpp = (
        "#define M(x) \\\n  do { x(); } while (0)\n"
        "namespace a {\n// f() {\nstruct S {\n  int g(int x) const {\n    return x;\n  }\n};\n"
        "template <int N>\nvoid f(\n    int x) {\n  if (x) {\n    x = '{';\n  }\n}\n}\n"
    )
    assert cpp_function_lines(cpp) == {"int g(int x)@6": 3, "template <int N>@10": 7}


def test_no_experiments_file_is_over_the_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "experiments").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"split these by job (over {MAX_FILE_LINES} lines): {long}"


def test_no_experiments_function_is_over_the_limit():
    long = {
        f"{p.relative_to(ROOT)}:{name}": n
        for p in sorted((ROOT / "experiments").rglob("*.py"))
        for name, n in python_function_lines(p.read_text()).items()
        if n > MAX_FUNCTION_LINES
    }
    assert not long, f"split these into named helpers (over {MAX_FUNCTION_LINES} lines): {long}"


def test_no_library_function_is_over_the_limit():
    long = {}
    for p in sorted((ROOT / "ultraep_jax").rglob("*.py")):
        for name, n in python_function_lines(p.read_text()).items():
            if n > MAX_FUNCTION_LINES:
                long[f"{p.relative_to(ROOT)}:{name}"] = n
    for p in sorted((ROOT / "ffi").iterdir()):
        if p.suffix in (".h", ".cc", ".cu"):
            for name, n in cpp_function_lines(p.read_text()).items():
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{name}"] = n
    assert not long, f"split these (over {MAX_FUNCTION_LINES} lines of code): {long}"
