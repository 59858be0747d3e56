"""``python -m kvstore``: the same as the ``kvstore`` command."""

from kvstore.cli import main

raise SystemExit(main())
