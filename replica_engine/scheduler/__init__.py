from replica_engine.scheduler.core import Scheduler, SchedulerConfig
from replica_engine.scheduler.plan import StepPlan
from replica_engine.scheduler.policies import SCHEDULING_POLICIES

__all__ = ["SCHEDULING_POLICIES", "Scheduler", "SchedulerConfig", "StepPlan"]
