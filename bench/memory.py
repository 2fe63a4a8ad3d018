"""gpt2-small, gpt2-large and llama-1b through `zinfjax train` in memory cgroups; prints one JSON object.

See zinfjax/benchmarks/memory.py.

Example:
    $ python bench/memory.py --dir runs/memory
"""

import sys

from zinfjax.benchmarks.memory import main

if __name__ == "__main__":
    sys.exit(main())
