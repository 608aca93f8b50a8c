"""``python -m pyengine``: the same as the ``pyengine`` command."""

import sys

from .cli import main

sys.exit(main())
