"""The step-time planner: what one training step of a layout communicates (``collectives``), how long it takes on a
cluster (``cluster``, ``efficiency``, ``schedules``, ``step_time``) and which layouts of a GPU count fit and run
fastest (``search``). ``nanotron estimate`` prints its answers; docs/planning.md states its rules."""
