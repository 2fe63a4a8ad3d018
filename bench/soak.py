"""`zinfjax train` for 2,000 steps with every tier on NVMe, sampled from outside; prints one JSON object.

See zinfjax/benchmarks/soak.py.

Example:
    $ python bench/soak.py --dir runs/soak --steps 2000 --memory-limits none,1GiB -o runs/soak/soak.png
"""

import sys

from zinfjax.benchmarks.soak import main

if __name__ == "__main__":
    sys.exit(main())
