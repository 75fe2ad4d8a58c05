"""``python -m gemmaserve`` = the ``gemmaserve`` CLI."""

from gemmaserve.cli import main

raise SystemExit(main())
