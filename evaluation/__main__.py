"""``python -m evaluation ...`` is ``megatron-arpo eval ...`` (see evaluation.cli)."""

import sys

from evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
