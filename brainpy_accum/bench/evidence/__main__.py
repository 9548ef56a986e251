"""``python -m brainpy_accum.bench.evidence``."""

from . import main

main()
