"""``python -m senseshield.cli``: the same as the ``senseshield`` command."""

from senseshield.cli.main import main

main()
