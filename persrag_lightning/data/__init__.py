"""Data formats and sources: LaMP folders, log conversion, SynthLaMP, PersonaBench, corpora and the
on-disk caches."""

__all__ = ["augment", "candidates", "convert", "corpus", "docstore", "feedback_cache", "histories", "lamp",
           "lamp_format", "lamp_write", "log_files", "personabench", "prompt_store", "records", "source", "splits",
           "synth", "synth_scale", "synth_text", "synth_world", "tasks"]  # the package's modules, imported on use
