"""Engine vs reference step and the I/O floor; prints one JSON object. See zinfjax/benchmarks/step.py.

Example:
    $ python bench/step.py --dir runs/step
"""

import sys

from zinfjax.benchmarks.step import main

if __name__ == "__main__":
    sys.exit(main())
