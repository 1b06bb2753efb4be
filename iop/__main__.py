"""``python -m iop``: the ``iop`` command (:func:`iop.cli.main`)."""

import sys

from iop.cli import main

sys.exit(main())
