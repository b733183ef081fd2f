"""``python -m nanotron ...`` is the ``nanotron`` command."""

from nanotron.cli import main

main()
