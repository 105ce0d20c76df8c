"""python -m fxamp"""
import sys

from .cli import main

sys.exit(main())
