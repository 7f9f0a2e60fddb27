"""What a run will do, decided before anything starts: the environment it runs in (the one
reader of SLURM, torchrun and Ray variables and of the devices) and the plan's rules.

Pure decisions on the driver side; the plan travels to the workers as data.
"""
