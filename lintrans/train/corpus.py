"""The embedded default corpus: English text every Python installation already has.

``python-docs`` is the text of the Python documentation that ships inside the standard library:
the language/library reference topics behind ``help()`` (``pydoc_data.topics``) followed by the
docstrings of the standard-library modules, classes and functions, in sorted file order. It is
about 2 MB of real prose (about 0.5M GPT-2 tokens) on Python 3.11, needs no network and no
download, and is covered by the PSF licence of the Python distribution it is read from. Its exact
content depends on the Python version, so the data cache keys on its hash.
"""
from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

BUILTIN_CORPORA = ("python-docs",)
CORPUS_VERSION = 1  # bump when the extraction below changes, so cached tokens are rebuilt

# Parts of the stdlib that are tests, demos or GUI code: their docstrings are noise, not prose.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "tkinter"}


def builtin_corpus_files(name: str) -> list[Path]:
    """The files built-in corpus ``name`` is read from (their bytes key the token cache)."""
    _check_name(name)
    import pydoc_data.topics

    return [Path(pydoc_data.topics.__file__)] + _stdlib_files()


def builtin_corpus(name: str) -> list[str]:
    """The documents of built-in corpus ``name``; each is one text, separated by end-of-text in training."""
    _check_name(name)
    return _topics() + _stdlib_docstrings()


def _check_name(name: str) -> None:
    if name not in BUILTIN_CORPORA:
        raise ValueError(f"built-in corpus must be one of {list(BUILTIN_CORPORA)}, got {name!r}")


def _topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        path for path in sorted(root.rglob("*.py"))
        if not _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]) and not path.name.startswith("test_")
    ]


def _stdlib_docstrings() -> list[str]:
    """One document per module: its docstrings joined by blank lines, modules in sorted path order."""
    docs = []
    for path in _stdlib_files():
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
