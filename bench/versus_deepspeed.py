"""GPT-2 small under DeepSpeed ZeRO-3 and under `zinfjax train`, NVMe, CPU and in memory; prints one JSON object.

See zinfjax/benchmarks/versus_deepspeed.py and docs/BENCHMARKS.md.

Example:
    $ python bench/versus_deepspeed.py --dir runs/versus-deepspeed
"""

import sys

from zinfjax.benchmarks.versus_deepspeed import main

if __name__ == "__main__":
    sys.exit(main())
