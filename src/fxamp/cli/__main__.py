"""python -m fxamp.cli (the same as python -m fxamp)"""
import sys

from . import main

sys.exit(main())
