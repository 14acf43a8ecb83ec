"""``reshard``: rewrite EP tensors between layout versions and mesh sizes (``docs/layouts.md``).

:mod:`.plan` decides from metadata which source bytes go where; :mod:`.execute` streams them.
"""

from ckpttool.ops.reshard.execute import ReshardOptions, ReshardResult, execute_plan, reshard
from ckpttool.ops.reshard.plan import ReshardPlan, plan_reshard

__all__ = ["ReshardOptions", "ReshardPlan", "ReshardResult", "execute_plan", "plan_reshard", "reshard"]
