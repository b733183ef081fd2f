"""The pieces of ``nanotron.trainer``: building a run (``build.py``), its checkpoints (``checkpointing.py``), its step
(``step.py``: the step program; ``objective.py``: the step terms) and the record of each step (``step_log.py``)."""
