"""Code that runs inside every Ray Train worker (and every Tune trial): the training loop
and everything only it uses.

Nothing here imports from ``raytrain_app.driver``: a worker may run on another machine
than the driver, and shares with it only the task it was sent and the run's storage.
"""
