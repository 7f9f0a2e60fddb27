"""Checkpoints: the files and their manifest, what a resumable one holds, which one is the
best, how many Ray keeps, and loading a trained model back.

Used by the workers (saving, resuming), the driver (the best checkpoint of a run) and the
public API (``load_model``).
"""
