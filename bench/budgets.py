"""One model through `zinfjax train` at several memory budgets (tiers=auto), against each step's floor; prints JSON.

See zinfjax/benchmarks/budgets.py.

Example:
    $ python bench/budgets.py --model gpt2-large --budgets 3GiB,5GiB,7GiB,9GiB,11GiB,14GiB --all-host 14GiB
"""

import sys

from zinfjax.benchmarks.budgets import main

if __name__ == "__main__":
    sys.exit(main())
