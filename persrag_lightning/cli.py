"""`python train.py` / `persrag`: the entry point; it dispatches to the subcommands in commands/ and
turns bad input into one clear line with exit code 2."""

from __future__ import annotations

import sys

from persrag_lightning.commands.train import lightning_command, resolve_config_args
from persrag_lightning.logs import configure_logs, pop_verbose

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Entry point of `train.py` and the `persrag` console script: bad input ends with one clear
    line."""
    from persrag_lightning.data.lamp import LampFormatError
    from persrag_lightning.data.personabench import PersonaBenchFormatError
    from persrag_lightning.llm.base import LLMBackendError
    from persrag_lightning.utils import ConfigError

    try:
        run(argv)
    except (LampFormatError, PersonaBenchFormatError, LLMBackendError, FileNotFoundError, ConfigError) as err:
        print(f"persrag: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err


def run(argv: list[str] | None = None) -> None:
    """`--verbose` (anywhere on the line) keeps the libraries' logs and progress bars; see
    logs.py."""
    args, verbose = pop_verbose(list(sys.argv[1:] if argv is None else argv))
    configure_logs(verbose)
    args = resolve_config_args(args)
    if args and args[0] == "feedback":
        from persrag_lightning.commands.feedback import feedback_command

        return feedback_command(args[1:])
    if args and args[0] == "evaluate":
        from persrag_lightning.commands.evaluate import evaluate_command

        return evaluate_command(args[1:])
    if args and args[0] == "serve":
        from persrag_lightning.commands.serve import serve_command

        return serve_command(args[1:])
    if args and args[0] == "cluster":
        from persrag_lightning.commands.cluster import cluster_command

        return cluster_command(args[1:])
    if args and args[0] == "data":
        from persrag_lightning.commands.data import data_command

        return data_command(args[1:])
    if args and args[0] == "pipeline":
        from persrag_lightning.pipeline.command import main as pipeline_main

        return pipeline_main(args[1:])
    return lightning_command(args, from_sys_argv=argv is None)


if __name__ == "__main__":
    main()
