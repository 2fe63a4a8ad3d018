"""A 20 GiB training state in 2 GiB of memory; prints one JSON object. See zinfjax/benchmarks/capacity.py.

Example:
    $ python bench/capacity.py --memory-limit 2GiB --state-bytes 20GiB --dir runs/capacity
"""

import sys

from zinfjax.benchmarks.capacity import main

if __name__ == "__main__":
    sys.exit(main())
