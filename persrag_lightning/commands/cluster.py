"""`persrag cluster`: ClusterRAG's user cohorts (seed 002) built once and exported to
`checkpoints/<run>/clusters/`.

The cohorts are fitted exactly as the ClusterRAG strategy fits them (`ClusterRAG.fit_cohorts`: MEAN
of the frozen encoder's doc vectors over each user's collaborative pool, data/histories.py, or
CFRAG's trained user table) and written with `CohortModel.save` (assignments.tsv, centroids.npy,
vectors.npy, radii.npy, cohorts.json with the settings, sizes and noise count) into a temporary
folder that replaces `clusters/` whole, so a killed run leaves the previous export or none, never a
mix. On SynthLaMP (a `communities.json` beside the data) it also prints the adjusted Rand index of
the cohorts against the latent communities for MEAN and for the trained contrastive user vectors
(when `checkpoints/<run>/user_encoder` is exported) — diagnostics only, also written to
diagnostics.json.

    persrag cluster --run_name synthlamp-quick                 # HDBSCAN(min_cluster_size=2) over
    MEAN vectors persrag cluster --run_name synthlamp-quick --vectors encoder --method kmeans
    --n_clusters 8
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import asdict, replace
from pathlib import Path

from persrag_lightning.retrieval.cohort_settings import CohortSettings
from persrag_lightning.stages import bundle_path, run_folder
from persrag_lightning.utils import one_flag_style

__all__ = ["cluster_command", "report"]

EXPORT = "clusters"
DIAGNOSTICS = "diagnostics.json"


class ClusterArgumentError(ValueError):
    """Bad command-line input: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints usage + error on two lines; the house rule is one
    def error(self, message: str) -> None:
        raise ClusterArgumentError(message)


def parser() -> argparse.ArgumentParser:
    d = CohortSettings()
    p = _Parser(prog="persrag cluster", description=__doc__.splitlines()[0])
    p.add_argument(
        "--run_name", default="synthlamp", help="exports go to <export_root>/<run_name>/clusters"
    )
    p.add_argument("--export_root", default="checkpoints")
    p.add_argument("--task", default="LaMP-2")
    p.add_argument(
        "--data_dir", default=None, help="a LaMP folder; default: the embedded SynthLaMP"
    )
    p.add_argument("--num_users", type=int, default=300, help="SynthLaMP users (as the stages' synth.num_users)")
    p.add_argument("--synth_seed", type=int, default=0)
    p.add_argument("--cache_dir", default=".cache/persrag")
    p.add_argument(
        "--encoder", default="minilm", help="frozen text encoder of the MEAN user vectors (Eq. 1)"
    )
    p.add_argument("--vectors", choices=["mean", "encoder"], default=d.user_vectors,
                   help="user vectors of the export: MEAN (the seed) or CFRAG's trained user embeddings")
    p.add_argument("--method", choices=["hdbscan", "kmeans"], default=d.method)
    p.add_argument("--min_cluster_size", type=int, default=d.min_cluster_size)
    p.add_argument("--min_samples", type=int, default=d.min_samples)
    p.add_argument(
        "--n_clusters", type=int, default=d.n_clusters, help="k-means K (default ⌈√users⌉)"
    )
    p.add_argument("--noise", choices=["nearest", "own"], default=d.noise)
    p.add_argument("--fit_sample", type=int, default=d.fit_sample,
                   help="cluster a random sample of this many users, assign the others to the nearest cohort")
    p.add_argument("--top_k_users", type=int, default=d.top_k_users)
    p.add_argument("--seed", type=int, default=d.seed)
    return one_flag_style(p)


def _settings_from(args: argparse.Namespace) -> CohortSettings:
    """CohortSettings of the arguments; impossible values are bad input (one line), not a traceback
    later.

    Args:
        args: the parsed `persrag cluster` arguments (method, cluster sizes, noise policy, fit
            sample).
    """
    for name, low in (("min_cluster_size", 2), ("n_clusters", 1), ("fit_sample", 2), ("min_samples", 1),
                      ("top_k_users", 0), ("num_users", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ClusterArgumentError(f"--{name} must be ≥ {low}, got {value}")
    return CohortSettings(user_vectors=args.vectors, method=args.method, min_cluster_size=args.min_cluster_size,
                          min_samples=args.min_samples, n_clusters=args.n_clusters, top_k_users=args.top_k_users,
                          noise=args.noise, fit_sample=args.fit_sample, seed=args.seed)


def cluster_command(argv: list[str]) -> dict:
    """Fit, export and summarise the cohorts; returns what diagnostics.json holds. Bad input → one
    line, exit 2.

    Args:
        argv: the command line after `persrag cluster`.
    """
    try:
        args = parser().parse_args(argv)
        settings = _settings_from(args)
    except ClusterArgumentError as err:
        print(f"persrag cluster: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    return run(args, settings)


def _adjusted_rand(model, fit, communities: dict, fitted: str, has_encoder: bool) -> dict:
    """ARI against the latent communities of each kind of user vectors, fitted with the same
    settings (`fit`; `model` is the one of `fitted`), None for `encoder` without a stage-1 export."""
    ari: dict = {}
    for vectors in ("mean", "encoder"):
        if vectors == "encoder" and not has_encoder:
            ari["encoder"] = None
            continue
        m = model if vectors == fitted else fit(vectors)[0]
        truth = [communities.get(u, -1) for u in m.user_ids]
        ari[vectors] = {"clusters": m.adjusted_rand(truth), "cohorts": m.adjusted_rand(truth, after_policy=True),
                        "n_cohorts": m.n_cohorts, "noise": m.noise_count}
    return ari


def run(args: argparse.Namespace, settings: CohortSettings) -> dict:
    from persrag_lightning.bundles import require_bundle
    from persrag_lightning.commands.train import check_task
    from persrag_lightning.data.source import LampSource
    from persrag_lightning.data.synth import SynthConfig, load_communities
    from persrag_lightning.retrieval.base import DocStore
    from persrag_lightning.retrieval.clusterrag import ClusterRAG, ClusterRAGSettings, CorpusEmbedder
    from persrag_lightning.utils import atomic_directory, atomic_write_json

    check_task(args.task)
    run_dir = run_folder(args.export_root, args.run_name)
    encoder_dir = bundle_path(run_dir, "user_encoder")
    has_encoder = (encoder_dir / "config.json").is_file()
    if settings.user_vectors == "encoder":
        # FileNotFoundError naming the command that makes it → one line, exit 2
        require_bundle(encoder_dir)
    source = LampSource(args.task, args.data_dir, SynthConfig(num_users=args.num_users, seed=args.synth_seed),
                        args.cache_dir)
    source.prepare()
    store = DocStore(source.load())
    embedder = CorpusEmbedder(args.encoder, args.cache_dir)
    doc_vectors = embedder.doc_vectors(store)

    def fit(user_vectors: str):
        s = replace(settings, user_vectors=user_vectors)
        rag = ClusterRAG(embedder, ClusterRAGSettings("collab", s), args.cache_dir,
                         user_encoder=str(encoder_dir) if user_vectors == "encoder" else None, prompt_gamma=None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = rag.fit_cohorts(store, doc_vectors)
        return model, [str(w.message) for w in caught]

    model, said = fit(settings.user_vectors)
    if settings.user_vectors == "mean":
        # serving computes a new user's MEAN vector with the same encoder
        model.encoder = args.encoder
    communities = load_communities(source.data_dir)
    diagnostics: dict = {"data_dir": str(source.data_dir), "settings": asdict(settings), "users": len(model),
                         "cohorts": model.n_cohorts, "noise": model.noise_count, "warnings": said, "ari": {}}
    if communities:
        diagnostics["ari"] = _adjusted_rand(model, fit, communities, settings.user_vectors, has_encoder)
    out = run_dir / EXPORT
    with atomic_directory(out) as tmp:
        model.save(tmp)
        atomic_write_json(tmp / DIAGNOSTICS, diagnostics)
    print(report(model, diagnostics, communities is not None, out))
    return diagnostics


def report(model, diagnostics: dict, synth: bool, out: Path) -> str:
    """The cohort summary, any degenerate-case warning, the ARI table (SynthLaMP) and where the
    export is.

    Args:
        model: the fitted cohort model; its `summary()` opens the report.
        diagnostics: what diagnostics.json holds: the degenerate-case warnings and, on SynthLaMP,
            the ARI of each kind of user vectors.
        synth: whether the data is the embedded SynthLaMP, whose true communities give the ARI
            table.
        out: the folder the cohorts were exported to, named on the last line.
    """
    lines = [model.summary()]
    lines += [f"warning: {w}" for w in diagnostics["warnings"]]
    if synth:
        lines.append(
            "agreement with the true SynthLaMP communities (adjusted Rand index; diagnostics only):"
        )
        lines.append("| user vectors | cohorts | noise | ARI (noise as singletons) | ARI (after the noise policy) |")
        lines.append("|---|---|---|---|---|")
        for vectors, name in (("mean", "MEAN (Eq. 1)"), ("encoder", "contrastive (CFRAG stage 1)")):
            got = diagnostics["ari"].get(vectors)
            if got is None:
                lines.append(f"| {name} | - | - | not exported: `python train.py fit --config "
                             "cfrag_user_encoder.yaml` (same --run_name) | - |")
            else:
                lines.append(
                    f"| {name} | {got['n_cohorts']} | {got['noise']} | {got['clusters']:.3f} | "
                    f"{got['cohorts']:.3f} |"
                )
    else:
        lines.append("no communities.json beside the data: no ARI (SynthLaMP only)")
    lines.append(f"cohorts exported to {out}")
    return "\n".join(lines)
