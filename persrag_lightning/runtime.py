"""The float32 GEMM path of this CPU, beside the precision policy of hardware.py: which library
multiplies the reader's and the encoders' float32 matrices fastest here, measured once per process,
and applied to a model's Linear layers at inference.

torch's float32 matmul is MKL's; on some CPUs another library is faster at the same shapes (oneDNN's
linear, OpenBLAS through numpy, OpenVINO, ONNX Runtime: docs/performance/runtime.md). The policy
times each path at the shapes of the reader's MLP (SmolLM2-135M) and of the encoders' layers
(MiniLM) and chooses among those in torch's own thread pool, keeping torch's unless another is
clearly faster; the libraries with threads of their own are measured and shown, and used only where
named. A path that cannot load (its package missing) is skipped with a line. `PERSRAG_GEMM` names a
path instead of measuring (`torch`: every Linear stays as it is), or one per consumer
(`reader:onednn,encoders:torch`, the pin a measured choice prints and pipeline.json keeps): the paths
sum in different orders, so a trained reader's answers and a main job's table can move with the path
(docs/fidelity.md). Training never changes: a
converted layer runs torch's own linear whenever autograd, autocast, training mode or a non-float32
or non-CPU input is involved, and its weights stay the module's parameters (state dicts and exports
are unchanged). The paths themselves, one per library, are in gemm_paths.py.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from persrag_lightning.gemm_paths import PATHS, GemmPath, LinearFn

__all__ = ["ENV", "GEMM_SHAPES", "PATHS", "GemmChoice", "announce", "follow_recorded", "gemm_choice",
           "gemm_seconds", "gflops", "loadable_paths", "pinned_paths", "use_fastest_gemm"]

Timer = Callable[[str, LinearFn, torch.Tensor], float]

# (rows, in, out) of the Linear layers whose speed decides each consumer. The reader: SmolLM2-135M's
# MLP (hidden 576, intermediate 1536) on a batch of 8 main-job prompts; the encoders: MiniLM's
# feed-forward and attention projections (hidden 384, intermediate 1536) on a batch of 64 texts of
# 64 tokens.
GEMM_SHAPES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "reader": ((5728, 576, 1536), (5728, 1536, 576)),
    "encoders": ((4096, 384, 1536), (4096, 384, 384)),
}
# Another path replaces torch's only where it measures at least this much faster: a loaded machine's
# noise must not flip the choice, and a converted layer keeps a second copy of its weights in the
# path's layout.
MIN_GAIN = 1.1
# timed calls per shape, after one warm-up; the best counts (noise on a shared machine only slows)
ROUNDS = 3
# Fewer rows than this (a decoding step's) stay on torch: the policy measured batch shapes, and at a
# handful of rows a call's fixed cost outside the kernel decides.
MIN_ROWS = 32
ENV = "PERSRAG_GEMM"  # auto (measure) or a path's name


# ---- measuring and choosing ----------------------------------------------------------------------

def time_call(name: str, fn: LinearFn, x: torch.Tensor) -> float:
    """Seconds of one call of `fn(x)`; `name` is the path's, for a timer that wants it (a test's
    fake clock)."""
    started = time.perf_counter()
    fn(x)
    return time.perf_counter() - started


def gemm_seconds(
    name: str, fn: LinearFn, x: torch.Tensor, rounds: int = ROUNDS, timer: Timer = time_call
) -> float:
    """Seconds of one call of `fn(x)`: the best of `rounds` after a warm-up (which pays first-call
    allocations and kernel choices); noise on a shared machine only slows, so the best call is the
    machine's rate."""
    with torch.inference_mode():
        fn(x)
        return min(timer(name, fn, x) for _ in range(rounds))


def gflops(shapes: tuple[tuple[int, int, int], ...], seconds: float) -> float:
    """The rate, in billions of floating-point operations per second, of one pass over `shapes`
    (twice rows times in times out operations each) in `seconds`."""
    return sum(2 * r * i * o for r, i, o in shapes) / seconds / 1e9


def _shape_data(
    shape: tuple[int, int, int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An input, a weight and a bias of a Linear of `shape` (rows, in, out), random (scaled as an
    initialised layer)."""
    rows, d_in, d_out = shape
    return (torch.randn(rows, d_in, generator=gen), torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5,
            torch.randn(d_out, generator=gen))


def _measure_path(path: GemmPath, shapes: tuple[tuple[int, int, int], ...], threads: int,
                 timer: Timer = time_call) -> float:
    """The rate of `path` over `shapes` on `threads` threads (`gflops`; random weights of each
    shape, seed 0)."""
    gen = torch.Generator().manual_seed(0)
    seconds = 0.0
    for shape in shapes:
        x, w, b = _shape_data(shape, gen)
        seconds += gemm_seconds(path.name, path.prepare(w, b, threads), x, ROUNDS, timer)
    return gflops(shapes, seconds)


@dataclass
class GemmChoice:
    """What the policy measured and chose: the rate per consumer and path (`gflops`), the path each
    consumer uses, the paths skipped (and why), torch's thread count; pipeline.json keeps
    `record()`."""

    threads: int
    rates: dict[str, dict[str, float]]
    chosen: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)
    forced: bool = False  # PERSRAG_GEMM or a served run's record named the path: nothing was measured
    named_by: str = ENV  # which of the two, where forced

    def pin(self) -> str:
        """The `PERSRAG_GEMM` value that gives another run these paths without measuring: a path's
        name where every consumer has it, else `consumer:path` pairs."""
        paths = set(self.chosen.values())
        return paths.pop() if len(paths) == 1 else ",".join(f"{c}:{p}" for c, p in self.chosen.items())

    def lines(self) -> list[str]:
        """The run's lines: one per skipped path, then the choice of each consumer with every
        measured rate, and the pin that repeats it."""
        out = [f"float32 GEMM path {name}: skipped ({why})" for name, why in self.skipped.items()]
        if self.forced:
            return [*out, f"float32 GEMM path: {self.pin()} ({self.named_by}; not measured)"]
        for consumer, path in self.chosen.items():
            ranked = sorted(self.rates[consumer].items(), key=lambda kv: -kv[1])
            rates = ", ".join(f"{p} {r:.0f}" for p, r in ranked if _choosable(p))
            beside = ", ".join(f"{p} {r:.0f}" for p, r in ranked if not _choosable(p))
            beside = f"; beside torch's threads, chosen only when named: {beside}" if beside else ""
            out.append(
                f"float32 GEMM path for the {consumer}: {path} (GFLOP/s on {self.threads} threads: "
                f"{rates}{beside})"
            )
        # the choice follows the rates of the moment, and the table can follow the choice
        return [*out, f"{ENV}={self.pin()} gives another run these paths without measuring"]

    def record(self) -> dict:
        return {**asdict(self), "pin": self.pin()}


def _choosable(name: str) -> bool:
    """A path the policy may choose by measurement: one in torch's own thread pool
    (`GemmPath.own_threads`)."""
    return name not in PATHS or not PATHS[name].own_threads


def choose_path(rates: dict[str, float], min_gain: float = MIN_GAIN) -> str:
    """The fastest measured path that `_choosable` allows, unless it beats torch's by less than
    `min_gain` (then torch)."""
    best = max([p for p in rates if _choosable(p)] or rates, key=lambda p: rates[p])
    if "torch" in rates and best != "torch" and rates[best] < min_gain * rates["torch"]:
        return "torch"
    return best


def first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:160]


def measure_gemm(paths: list[GemmPath] | None = None, shapes: dict[str, tuple] | None = None,
                 threads: int | None = None, timer: Timer = time_call, rounds: int = ROUNDS) -> GemmChoice:
    """Time every path at each consumer's shapes and choose per consumer. The paths take turns, one
    call per shape in each of `rounds` rounds after a warm-up, so a burst of load from other jobs
    falls on every path alike; each keeps its best call. A path that fails to prepare or run is
    skipped, with the first line of its error."""
    paths = list(PATHS.values()) if paths is None else paths
    shapes = GEMM_SHAPES if shapes is None else shapes
    threads = torch.get_num_threads() if threads is None else threads
    gen = torch.Generator().manual_seed(0)
    data = {(c, shape): _shape_data(shape, gen) for c, dims in shapes.items() for shape in dims}
    calls: dict[tuple, LinearFn] = {}
    skipped: dict[str, str] = {}
    with torch.inference_mode():
        for path in paths:
            try:
                for key, (x, w, b) in data.items():
                    calls[(path.name, *key)] = path.prepare(w, b, threads)
                    calls[(path.name, *key)](x)  # the warm-up
            except Exception as err:  # noqa: BLE001 - any failure to load or run a path means: not this path here
                skipped[path.name] = first_line(err)
                calls = {k: fn for k, fn in calls.items() if k[0] != path.name}
        best: dict[tuple, float] = {}
        for _ in range(rounds):
            for key, fn in calls.items():
                best[key] = min(best.get(key, float("inf")), timer(key[0], fn, data[key[1:]][0]))
    if not calls:
        raise RuntimeError(f"no float32 GEMM path could run here: {skipped}")
    rates: dict[str, dict[str, float]] = {consumer: {} for consumer in shapes}
    for name in dict.fromkeys(key[0] for key in calls):
        for consumer, dims in shapes.items():
            rates[consumer][name] = gflops(
                dims, sum(best[(name, consumer, shape)] for shape in dims)
            )
    return GemmChoice(threads, rates, {c: choose_path(r) for c, r in rates.items()}, skipped)


def _thread_counts() -> list[int]:
    """torch's thread count, and the CPUs this process may run on where that differs (a machine
    whose torch counts physical cores but whose logical CPUs compute too): the thread settings the
    policy tries."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return sorted({torch.get_num_threads(), cpus})


def best_threads(counts: list[int], timer: Timer = gemm_seconds) -> int:
    """The thread count at which torch's own path runs the reader's shapes fastest (torch's count
    unless another is faster by MIN_GAIN)."""
    current = torch.get_num_threads()
    if len(counts) < 2:
        return current
    rates = {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            rates[str(n)] = _measure_path(PATHS["torch"], GEMM_SHAPES["reader"], n, timer)
    finally:
        torch.set_num_threads(current)
    best = max(rates, key=lambda n: rates[n])
    return int(best) if rates[best] >= MIN_GAIN * rates[str(current)] else current


def loads(name: str) -> None:
    """Refuse, at once and in one line, a path named by `PERSRAG_GEMM` that cannot load here (its
    extra missing)."""
    try:
        PATHS[name].prepare(torch.ones(2, 2), None, 1)
    except Exception as err:  # noqa: BLE001 - whatever stops it, the run would fail at its first layer
        raise ValueError(f"{ENV}={name}: this path cannot load here: {first_line(err)}") from None


def pinned_paths(wanted: str) -> dict[str, str]:
    """The path of each consumer that `PERSRAG_GEMM`'s value other than `auto` names: one path's
    name for every consumer, or `consumer:path` pairs separated by commas (`GemmChoice.pin`), a
    consumer left out keeping torch's.

    Args:
        wanted: the variable's value.
    """
    if ":" not in wanted:
        if wanted not in PATHS:
            raise ValueError(f"{ENV}={wanted!r}: use auto or one of {', '.join(PATHS)}")
        return dict.fromkeys(GEMM_SHAPES, wanted)
    chosen = dict.fromkeys(GEMM_SHAPES, "torch")
    for pair in wanted.split(","):
        consumer, _, path = (part.strip() for part in pair.partition(":"))
        if consumer not in GEMM_SHAPES or path not in PATHS:
            raise ValueError(f"{ENV}={wanted!r}: {pair.strip()!r} is not <consumer>:<path> with a consumer of "
                             f"{', '.join(GEMM_SHAPES)} and a path of {', '.join(PATHS)}")
        chosen[consumer] = path
    return chosen


def loadable_paths(wanted: str) -> dict[str, str]:
    """`pinned_paths(wanted)`, each path named refused at once (`loads`) where it cannot load here."""
    chosen = pinned_paths(wanted)
    for name in dict.fromkeys(chosen.values()):
        loads(name)
    return chosen


_CHOICES: dict[tuple[str, int], GemmChoice] = {}
_FOLLOWED: dict[str, str] = {}  # "pin": a served run's recorded paths, this process's where PERSRAG_GEMM is unset


def follow_recorded(pin: str | None) -> str:
    """Take the float32 GEMM paths a run's record names (`pin`, as `PERSRAG_GEMM` writes them) as this
    process's wherever `PERSRAG_GEMM` is unset: a served model then sums in the order the run's table
    did, and an answer near a tie is the table's. A record without paths, or a path that cannot load
    here, leaves the choice to measurement; `PERSRAG_GEMM` set wins. Process-wide, as the variable
    is: models already converted keep their path. Returns one line saying which.

    Args:
        pin: the record's paths (`record.Reference.gemm`); None: the run recorded none.
    """
    _FOLLOWED.pop("pin", None)  # a run loaded before does not lend its paths to this one
    if os.environ.get(ENV, "").strip():
        return f"float32 GEMM paths: {ENV}={os.environ[ENV].strip()} (the run's record: {pin or 'none'})"
    if pin is None:
        return "float32 GEMM paths: measured here (the run's record names none)"
    try:
        loadable_paths(pin)
    except ValueError as err:
        return f"float32 GEMM paths: measured here; the run's {pin} cannot be taken here ({err})"
    _FOLLOWED["pin"] = pin
    return f"float32 GEMM paths: {pin}, as the run's record says ({ENV}=auto measures this machine's instead)"


def gemm_choice() -> GemmChoice:
    """This process's choice: `PERSRAG_GEMM` (`pinned_paths`) if set, else the paths of a served run's
    record (`follow_recorded`), else measured once per thread count; where another thread count runs
    torch's matmul faster, torch is set to it first."""
    named = os.environ.get(ENV, "").strip()
    wanted = named or _FOLLOWED.get("pin", "auto")
    key = (wanted, torch.get_num_threads())
    if key not in _CHOICES:
        if wanted == "auto":
            threads = best_threads(_thread_counts())
            torch.set_num_threads(threads)
            choice = measure_gemm(threads=threads)
        else:
            chosen = loadable_paths(wanted)
            choice = GemmChoice(key[1], {}, chosen, forced=True, named_by=ENV if named else "the run's record")
        _CHOICES[key] = _CHOICES[(wanted, choice.threads)] = choice
    return _CHOICES[key]


_ANNOUNCED: set[int] = set()


def announce(choice: GemmChoice, prefix: str = "[runtime]", again: bool = False) -> None:
    """Print `choice.lines()` once per process, whoever asks first (the pipeline before its plan, or
    the first model converted); `again`: print them even if they were (each pipeline run states its
    decisions)."""
    if again or id(choice) not in _ANNOUNCED:
        _ANNOUNCED.add(id(choice))
        print("\n".join(f"{prefix} {line}" for line in choice.lines()), flush=True)


# ---- applying a path to a model ------------------------------------------------------------------

# layer -> (weights' version key, function)
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GemmLinear(nn.Linear):
    """An nn.Linear whose float32 inference calls go through the GEMM path `gemm_path` (its weights
    packed on first use, again after they change); every other call is nn.Linear's. Made by
    `apply_gemm_path`, never built."""

    gemm_path: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._torchs(x):
            return super().forward(x)
        return self._prepared()(x.contiguous())

    def _torchs(self, x: torch.Tensor) -> bool:
        """Whether this call is torch's: autograd, training mode, autocast, a non-float32 or non-CPU
        tensor, a handful of rows, or a trace (an ONNX export, torch.compile) that must see torch's
        own operator."""
        return (torch.is_grad_enabled() or self.training or x.dtype != torch.float32 or x.device.type != "cpu"
                or self.weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
                or x.numel() < MIN_ROWS * x.shape[-1] or torch.jit.is_tracing() or torch.compiler.is_compiling()
                or torch.onnx.is_in_onnx_export())

    def _prepared(self) -> LinearFn:
        key = tuple((t._version, t.data_ptr()) for t in (self.weight, self.bias) if t is not None)
        cached = _PREPARED.get(self)
        if cached is None or cached[0] != key:
            cached = (key, PATHS[self.gemm_path].prepare(self.weight, self.bias, torch.get_num_threads()))
            _PREPARED[self] = cached
        return cached[1]


def apply_gemm_path(model: nn.Module, path: str) -> int:
    """Route `model`'s nn.Linear layers through `path` at float32 inference (`torch`: back to plain
    nn.Linear), in place; the number of layers changed. Parameters, state dict and training are
    untouched."""
    if path not in PATHS:
        raise ValueError(f"unknown GEMM path {path!r}; one of {', '.join(PATHS)}")
    changed = 0
    for module in model.modules():
        kind = type(module)
        if kind is GemmLinear and path == "torch":
            module.__class__ = nn.Linear
            module.__dict__.pop("gemm_path", None)
        elif (
            kind is nn.Linear and path != "torch" or kind is GemmLinear and module.gemm_path != path
        ):
            module.__class__ = GemmLinear
            module.gemm_path = path
        else:
            continue
        _PREPARED.pop(module, None)
        changed += 1
    return changed


def use_fastest_gemm(model: nn.Module, consumer: str) -> str:
    """Apply this process's choice for `consumer` (reader, encoders) to `model` at inference,
    announcing the choice once; the path's name."""
    choice = gemm_choice()
    announce(choice)
    path = choice.chosen[consumer]
    if path != "torch":
        apply_gemm_path(model, path)
    return path
