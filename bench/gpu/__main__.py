"""`python -m bench.gpu`, the GPU path's own name for `python -m bench gpu`."""

import sys

from bench.__main__ import main

sys.exit(main(["gpu", *sys.argv[1:]]))
