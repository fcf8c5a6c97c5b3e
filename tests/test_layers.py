"""The package's floors: ops -> nn -> models -> train -> bench / experiments. A module imports only
from its own floor and those below it (and from the shared top-level modules such as
lintrans.tokenizer and lintrans.device)."""
import ast
import sys
from pathlib import Path

import lintrans

FLOORS = ["ops", "nn", "models", "train", "bench", "experiments"]
ROOT = Path(lintrans.__file__).parent


def imported(path: Path) -> list[tuple[int, str]]:
    package = ["lintrans", *path.relative_to(ROOT).parts[:-1]]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            out.append((node.lineno, ".".join(base + [node.module] if node.module else base)))
    return out


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if len(parts) < 2 or parts[0] not in FLOORS:
            continue
        floor = FLOORS.index(parts[0])
        for line, module in imported(path):
            names = module.split(".")
            if names[0] == "lintrans" and len(names) > 1 and names[1] in FLOORS and FLOORS.index(names[1]) > floor:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    return bad


def test_no_floor_imports_from_a_floor_above_it():
    assert upward_imports() == []


def test_the_check_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    """The test above can fail: a models module reaching up into train is caught either way."""
    fake = tmp_path / "lintrans"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "x.py").write_text("from ..train.tokenizer import get_tokenizer\nimport lintrans.bench.cli\n"
                                          "from lintrans.ops import linear_attention\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert upward_imports() == ["lintrans/models/x.py:1 imports lintrans.train.tokenizer",
                                "lintrans/models/x.py:2 imports lintrans.bench.cli"]


def test_the_old_import_names_still_work():
    from lintrans.device import resolve_device
    from lintrans.tokenizer import get_tokenizer
    from lintrans.train.distributed import resolve_device as old_resolve
    from lintrans.train.tokenizer import TOKENIZERS, get_tokenizer as old_get

    assert old_resolve is resolve_device and old_get is get_tokenizer and TOKENIZERS == ("gpt2", "bytes")
