"""Evaluation: LaMP tables, PersonaBench, memory evaluation, reports, intervals and the PersonaBench
metrics."""

__all__ = ["arguments", "base", "evaluate", "memory_eval", "personabench_eval", "personabench_metrics", "reader_free",
           "report", "stats"]  # the package's modules, imported on use
