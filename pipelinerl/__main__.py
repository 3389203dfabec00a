"""`python -m pipelinerl ...` is `pipelinerl ...`."""

import sys

from pipelinerl.cli import main

sys.exit(main())
