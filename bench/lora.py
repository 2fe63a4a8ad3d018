"""LoRA rank 16 on q, v of llama-7b (bf16) through `zinfjax train` in a 3 GiB cgroup, against its floor; prints JSON.

See zinfjax/benchmarks/lora.py.

Example:
    $ python bench/lora.py --dir runs/lora
"""

import sys

from zinfjax.benchmarks.lora import main

if __name__ == "__main__":
    sys.exit(main())
