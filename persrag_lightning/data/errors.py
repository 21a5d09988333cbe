"""The data room's error for bad LaMP input, below every module that raises it (lamp, folder_task, log
files), so none of them imports another for it."""

from __future__ import annotations

__all__ = ["LampFormatError"]


class LampFormatError(ValueError):
    """Bad LaMP input; the message names the file, the record (index and id) and the field."""
