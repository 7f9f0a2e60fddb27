"""Code that runs in the driver process only (the CLI, a notebook, a Ray job's entrypoint):
connecting to Ray, the run directory, the TorchTrainer, progress bars and stop signals.

Workers run none of it. They import from here only the modules that Ray's pickles name:
``trainer`` (the train loop's entry) and ``controller_in_driver`` (the stand-in for the
controller's handle): a few milliseconds, since a worker has loaded nearly all they import.
"""
