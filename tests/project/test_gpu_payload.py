"""benchmarks/gpu_payload.py without pip: archives cut into size-capped part folders, received one folder at a time,
checked by sha256 and unpacked; a part that arrives damaged is refused, and unpacking before every part came names
what is missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def payload(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_payload", REPO / "benchmarks" / "gpu_payload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RECEIVED", tmp_path / "received")
    return module


def xz_archive(tmp_path: Path, name: str, files: dict[str, bytes]) -> Path:
    stage = tmp_path / f"stage-{name}"
    for rel, data in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(data)
    archive = tmp_path / f"{name}.tar.xz"
    subprocess.run(f"tar -C {stage} -cf - . | xz -0 > {archive}", shell=True, check=True)
    return archive


def test_parts_are_capped_received_one_by_one_checked_and_unpacked(payload, tmp_path):
    a = xz_archive(tmp_path, "project-aaa", {"pkg_a/__init__.py": b"A = 1\n", "pkg_a/blob": os.urandom(5000)})
    b = xz_archive(tmp_path, "vllm-bbb", {"pkg_b/__init__.py": b"B = 2\n", "pkg_b/blob": os.urandom(9000)})
    out = tmp_path / "out"
    manifest = payload.cut_parts([a, b], out, part_bytes=4096)
    parts = sorted(out.glob("p[0-9][0-9]"))
    sizes = [sum(f.stat().st_size for f in p.iterdir() if f.name != payload.MANIFEST) for p in parts]
    assert len(parts) >= 4 and max(sizes) <= 4096 and sum(sizes) == a.stat().st_size + b.stat().st_size
    payload.receive(parts[0])
    with pytest.raises(SystemExit, match="chunks missing"):  # before every part arrived
        payload.unpack(tmp_path / "site", None)
    for part in parts[1:]:
        payload.receive(part)
    payload.unpack(tmp_path / "site", ["vllm"])  # one set alone
    assert (tmp_path / "site" / "pkg_b" / "__init__.py").read_bytes() == b"B = 2\n"
    assert not (tmp_path / "site" / "pkg_a").exists()
    payload.unpack(tmp_path / "site", None)
    assert (tmp_path / "site" / "pkg_a" / "blob").read_bytes() == (tmp_path / "stage-project-aaa" / "pkg_a" /
                                                                   "blob").read_bytes()
    assert [e["name"] for e in manifest["archives"]] == [a.name, b.name]


def test_a_damaged_part_is_refused(payload, tmp_path):
    a = xz_archive(tmp_path, "project-aaa", {"x": os.urandom(3000)})
    out = tmp_path / "out"
    payload.cut_parts([a], out, part_bytes=1024)
    first = next(p for p in (out / "p00").iterdir() if p.name != payload.MANIFEST)
    first.write_bytes(bytes([first.read_bytes()[0] ^ 1]) + first.read_bytes()[1:])
    for part in sorted(out.glob("p[0-9][0-9]")):
        payload.receive(part)
    with pytest.raises(SystemExit, match="sha256 mismatch"):
        payload.unpack(tmp_path / "site", None)

