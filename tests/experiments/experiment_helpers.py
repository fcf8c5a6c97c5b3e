"""Helpers shared by the study tests."""
import json

from lintrans.cli import main


def run_cli(name, out, *extra):
    """`lintrans experiment NAME --quick --out OUT ...` -> (exit code, stdout, stderr)."""
    return main(["experiment", name, "--quick", "--no-progress", "--out", str(out), *extra])


def check_record(out, name, pngs):
    data = json.loads((out / f"{name}.json").read_text())
    assert data["study"] == name and "cpu" in data["machine"] and data["settings"]["quick"] is True
    assert set(data["sweep"]["chosen"]) == set(data["settings"]["mechanisms"])
    for png in pngs:
        assert (out / f"{name}_{png}.png").read_bytes()[:4] == b"\x89PNG", png
    return data


def trained(captured: str) -> int:
    line = next(l for l in captured.splitlines() if "runs trained now" in l)
    return int(line.split("(")[1].split()[0])
