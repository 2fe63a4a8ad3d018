"""``zinfjax`` commands run in the test's own process, as a user types them: the exit status and what they print.

What a command prints is caught here, not by pytest's ``capsys``, so that module-scoped fixtures can run commands
too.
"""

import contextlib
import io
import math
import re

from zinfjax.cli import main


def cli(*argv) -> tuple[int, str, str]:
    """``zinfjax *argv`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def ok(*argv) -> tuple[str, str]:
    """``zinfjax *argv``, which must exit 0: (stdout, stderr)."""
    code, out, err = cli(*argv)
    assert code == 0, f"zinfjax {' '.join(map(str, argv))} exited {code}:\n{err[-3000:]}"
    return out, err


def sets(*settings) -> list[str]:
    """``--set`` before each of ``settings``."""
    return [a for s in settings for a in ("--set", str(s))]


def trained(out: str, steps: int) -> tuple[float, float]:
    """The first and last loss of ``zinfjax train``'s summary, ``trained STEPS steps: loss A -> B``: both finite."""
    found = re.search(rf"^trained {steps} steps: loss ([-+.\deE]+|nan|inf) -> ([-+.\deE]+|nan|inf)", out, flags=re.M)
    assert found, f"no summary of {steps} steps in: {out!r}"
    first, last = float(found[1]), float(found[2])
    assert math.isfinite(first) and math.isfinite(last), out
    return first, last
