"""Small shared helpers: atomic file writes (no half-written file on error) and content
fingerprints."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

__all__ = ["ConfigError", "as_settings", "atomic_directory", "atomic_open", "atomic_replace",
           "atomic_save_tensors", "atomic_write_json", "atomic_write_text", "bundle_digest",
           "file_digest", "fingerprint", "one_flag_style", "resolve_config_path",
           "trainer_validates"]

# The process umask, read once: mkstemp creates 0600 files, but a replaced file should get the usual
# mode.
_UMASK = os.umask(0)
os.umask(_UMASK)


def _temp_path(path: Path) -> Path:
    """A fresh, hidden temp file next to `path`, so the final os.replace stays on one filesystem."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def _commit(tmp: Path, path: Path) -> None:
    """Give the temp file normal permissions and move it over `path` in one atomic step."""
    os.chmod(tmp, 0o666 & ~_UMASK)
    os.replace(tmp, path)


@contextmanager
def atomic_replace(path: str | Path) -> Iterator[Path]:
    """Yield a temp path to write by any means; on success it replaces `path`, on error it is
    removed."""
    path = Path(path)
    tmp = _temp_path(path)
    try:
        yield tmp
        _commit(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            tmp.unlink()
        raise


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """Open a temp file for streaming writes; it replaces `path` only if the block finishes without
    error."""
    if "r" in mode or "a" in mode or "+" in mode:
        raise ValueError(f"atomic_open writes whole files; mode {mode!r} is not supported")
    with atomic_replace(path) as tmp, open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` through a temp file + os.replace, so readers never see a partial
    file."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    """Serialize first (a TypeError leaves `path` untouched), then write atomically."""
    text = json.dumps(obj, indent=indent, ensure_ascii=False) + "\n"
    return atomic_write_text(path, text)


def atomic_save_tensors(
    tensors: Mapping[str, Any], path: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """safetensors' save_file through a temp file, so a killed job never leaves a truncated
    checkpoint."""
    from safetensors.torch import (
        save_file,
    )  # imported lazily: utils must stay importable without torch

    with atomic_replace(path) as tmp:
        save_file(dict(tensors), str(tmp), metadata=metadata)
    return Path(path)


def _canonical(obj: Any) -> Any:
    """JSON fallback for fingerprints: paths as strings, dataclasses as dicts, sets sorted."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=lambda x: json.dumps(x, sort_keys=True, default=_canonical))
    raise TypeError(f"cannot fingerprint object of type {type(obj).__name__}")


def fingerprint(*parts: Any) -> str:
    """First 16 hex chars of sha256 over the canonical JSON of `parts`: equal inputs give equal
    cache keys."""
    text = json.dumps(
        parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_canonical
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def file_digest(path: str | Path, chunk_size: int = 1 << 20) -> str:
    """sha256 hex of a file's bytes, read in chunks so multi-GB data files do not fill memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def bundle_digest(path: str | Path) -> str:
    """Content digest of an exported bundle folder (all its files), for cache keys."""
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            h.update(f"{p.relative_to(path)}:{file_digest(p)}".encode())
    return h.hexdigest()[:16]


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temp folder beside `path`; on success it replaces `path` whole, on error it is
    removed, so an export folder is never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ConfigError(ValueError):
    """A setting that names something that does not exist (a strategy, a model); the CLI prints it
    as one line with exit code 2, like bad data."""


CONFIG_DIRS = (Path("configs"), Path(__file__).resolve().parents[1] / "configs")


def resolve_config_path(name: str) -> str:
    """A config name that is not a file is looked up in ./configs and in the repository's
    configs/."""
    if Path(name).exists():
        return name
    for folder in CONFIG_DIRS:
        if (folder / name).exists():
            return str(folder / name)
    return name


def trainer_validates(datamodule: Any) -> bool:
    """False when the datamodule's trainer validates nothing (`--trainer.limit_val_batches=0`: the
    quick preset's feedback and generator stages, whose one epoch keeps one checkpoint): then no dev
    split is built or read."""
    trainer = getattr(datamodule, "trainer", None)
    return trainer is None or getattr(trainer, "limit_val_batches", 1) != 0


def one_flag_style(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every `--long_option` of `parser` (and of its subcommands) written `--snake_case`, as
    LightningCLI's are (`--run_name`, `--data.init_args.data_dir`), with the `--kebab-case` spelling
    accepted as an alias; help lists the snake_case spelling first. Flags are spelled in full: an
    abbreviation would match both spellings. argparse has no public way to add a spelling to an
    existing option, hence its `_actions` and `_option_string_actions`, unchanged across Python
    releases."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                one_flag_style(sub)
            continue
        spellings = list(action.option_strings)
        for option in action.option_strings:
            if option.startswith("--"):
                spellings += ["--" + option[2:].replace("-", "_"), "--" + option[2:].replace("_", "-")]
        spellings = list(dict.fromkeys(spellings))
        action.option_strings = sorted(spellings, key=lambda s: s.startswith("--") and "-" in s[2:])
        for spelling in spellings:
            parser._option_string_actions.setdefault(spelling, action)
    return parser


def as_settings(cls: type, value: object) -> Any:
    """A settings dataclass `cls` from itself or from its fields as a mapping (nested settings
    likewise, JSON lists back into tuples): a stage module and a DataModule take their settings
    whole, and LightningCLI keeps their hyperparameters as the parsed config, so
    `load_from_checkpoint` hands them back as dicts."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"expected {cls.__name__} or a mapping of its fields, got {type(value).__name__}"
        )
    hints = typing.get_type_hints(cls)
    fields = {}
    for key, v in value.items():
        nested = [t for t in typing.get_args(hints.get(key)) or [hints.get(key)] if dataclasses.is_dataclass(t)]
        if isinstance(v, Mapping) and nested:
            v = as_settings(nested[0], v)
        fields[key] = tuple(v) if isinstance(v, list) else v
    return cls(**fields)
