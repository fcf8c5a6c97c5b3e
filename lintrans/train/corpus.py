"""The embedded default corpus: English text every machine with lintrans installed already has.

``python-docs`` is documentation prose that ships inside Python and NumPy (a dependency of
lintrans): the language/library reference topics behind ``help()`` (``pydoc_data.topics``), then
the docstrings of the standard-library modules, classes and functions, then those of NumPy, each
in sorted file order. It is about 3.6 MB of real prose (Python 3.11, NumPy 2.x), needs no network
and no download, and is covered by the PSF licence (Python) and the BSD licence (NumPy) of the
installations it is read from. Its exact content depends on those versions, so the data cache
keys on its hash.
"""
from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

from lintrans.checks import check_choice

BUILTIN_CORPORA = ("python-docs",)
CORPUS_VERSION = 2  # bump when the extraction below changes, so cached tokens are rebuilt

# Parts of the stdlib that are tests, demos or GUI code: their docstrings are noise, not prose.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "tkinter"}


def builtin_corpus_files(name: str) -> list[Path]:
    """The files built-in corpus ``name`` is read from (their bytes key the token cache)."""
    check_choice("built-in corpus", name, BUILTIN_CORPORA)
    import pydoc_data.topics

    return [Path(pydoc_data.topics.__file__)] + _stdlib_files() + _numpy_files()


def builtin_corpus(name: str) -> list[str]:
    """The documents of built-in corpus ``name``; each is one text, separated by end-of-text in training."""
    check_choice("built-in corpus", name, BUILTIN_CORPORA)
    return _topics() + _docstrings(_stdlib_files()) + _docstrings(_numpy_files())


def _topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        path for path in sorted(root.rglob("*.py"))
        if not _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]) and not path.name.startswith("test_")
    ]


def _numpy_files() -> list[Path]:
    import numpy

    root = Path(numpy.__file__).parent
    return [path for path in sorted(root.rglob("*.py")) if not {"tests", "testing"}.intersection(path.parts)]


def _docstrings(files: list[Path]) -> list[str]:
    """One document per module: its docstrings joined by blank lines, modules in the given order."""
    docs = []
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue  # a stdlib file this Python cannot parse (e.g. a deliberately broken fixture)
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) > 40:  # one-liners like "Return x." teach little
                    parts.append(text)
        if parts:
            docs.append("\n\n".join(parts))
    return docs
