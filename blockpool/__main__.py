"""``python -m blockpool``: the ``blockpool`` command (see :mod:`blockpool.cli`)."""

from blockpool.cli import main

raise SystemExit(main())
