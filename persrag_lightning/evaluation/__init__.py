"""Evaluation: LaMP tables, PersonaBench, memory evaluation, reports, intervals and the PersonaBench metrics."""
