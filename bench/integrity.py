"""The cost of checking each NVMe chunk's crc32c as a run reads it back (verify_chunks on / off); prints JSON.

See zinfjax/benchmarks/integrity.py.

Example:
    $ python bench/integrity.py --pairs 3 --precision bf16 --dir runs/integrity
"""

import sys

from zinfjax.benchmarks.integrity import main

if __name__ == "__main__":
    sys.exit(main())
