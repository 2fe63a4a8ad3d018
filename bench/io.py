"""Store vs raw-disk I/O benchmark; prints one JSON object. See zinfjax/benchmarks/io.py.

Example:
    $ python bench/io.py --dir /mnt/nvme/bench --bytes 2GiB
"""

import sys

from zinfjax.benchmarks.io import main

if __name__ == "__main__":
    sys.exit(main())
