"""The pieces of ``nanotron.trainer``: building a run (``build.py``), its checkpoints (``checkpointing.py``), its
objective (``loss.py``) and the record of each step (``step_log.py``)."""
