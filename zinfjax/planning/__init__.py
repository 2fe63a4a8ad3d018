"""``zinfjax plan``: the bytes of each part of the training state, where they fit, and how fast each placement runs.

The cost model is specified in docs/planning.md. Modules: `state` (bytes and budgets), `probes` (disk and copy
rates), `calibrate` (timed steps on a cut model), `cost` (fit, traffic, predicted step), `recommend` (the plan and
``tiers=auto``), `report` (the plan as text). For a machine described in a file (``zinfjax plan --machine``):
`machine` (the file), `scale` (a model's bytes and working memory from its shapes), `machine_plan` (the plan).
"""

from zinfjax.planning.recommend import PlanError, make_plan, resolve_auto
from zinfjax.planning.report import format_plan

__all__ = ["PlanError", "format_plan", "make_plan", "resolve_auto"]
