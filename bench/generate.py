"""Generation tokens/s per tier and batch size, and the I/O floor; prints one JSON object.

See zinfjax/benchmarks/generate.py.

Example:
    $ python bench/generate.py --dir runs/generate
"""

import sys

from zinfjax.benchmarks.generate import main

if __name__ == "__main__":
    sys.exit(main())
