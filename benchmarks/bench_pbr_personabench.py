"""Run PBR's variants on a PersonaBench community and print the table (quality, LLM calls/query, cold/warm time,
PageRank time per user). Overrides are OmegaConf dot-list items, e.g.

    python benchmarks/bench_pbr_personabench.py evaluation.data_dir=../shared/data/personabench/community_0 \
        'evaluation.variants=[Base,PBR w/o P-PRF]' evaluation.pbr.damping=1.0
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from persrag_lightning.evaluation.personabench_eval import (
    PersonaBenchReport,
    config_from_dict,
    run_personabench,
)

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "evaluate_personabench.yaml"))
    parser.add_argument("overrides", nargs="*", help="dot-list overrides (evaluation.pbr.theta=0.8)")
    parser.add_argument("--rewrite", metavar="OUT_DIR", default=None,
                        help="write an earlier run's table.md and table.png again from its results (no LLM)")
    args = parser.parse_args(argv)
    if args.rewrite:
        report = PersonaBenchReport.load(args.rewrite)
        report.write(args.rewrite)
        print(report.markdown())
        return 0
    # `evaluation.x=v` sets the evaluator's init_args (the config names its class by class_path)
    overrides = [o.replace("evaluation.", "evaluation.init_args.", 1)
                 if o.startswith("evaluation.") and not o.startswith("evaluation.init_args.") else o
                 for o in args.overrides]
    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(overrides))
    config = config_from_dict(OmegaConf.to_container(cfg.evaluation.init_args, resolve=True))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    report = run_personabench(config)
    print(report.markdown())
    print(f"total wall time {time.perf_counter() - t0:.1f} s; outputs in {config.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
