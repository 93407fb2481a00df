"""``python -m ridgeline``: the ``ridgeline`` command."""
import sys

from ridgeline.agent.cli import main

sys.exit(main())
