"""Code that runs in the driver process only (the CLI, a notebook, a Ray job's entrypoint):
connecting to Ray, the run directory, the TorchTrainer, progress bars and stop signals.

Workers never import from here.
"""
