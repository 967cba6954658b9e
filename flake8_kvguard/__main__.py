"""`python -m flake8_kvguard PATH...`: the same as `kvguard lint PATH...`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
