"""``python -m brainpy_accum.recipes.evidence``."""

from . import main

main()
