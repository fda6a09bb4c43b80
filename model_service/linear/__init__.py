"""The model's linear layers: one plan per weight, made at load (`plan_model`).

plan.py (what a plan says), planner.py (making it: candidates, exact/fast mode), verify.py
(checking paths against F.linear), product.py (computing a weight's product by its plan), and the
paths: blocked.py (radixkv's AVX-512 kernel), dot.py (its bf16 few-row kernel), packed.py
(oneDNN), short.py (transposed product, one-row split), fused.py (q/k/v and gate/up as one product), tuning.py (the timing run),
probe_memo.py (the probes' answers kept on disk between starts).
"""

from model_service.linear.plan import MODES, LinearPlan, RowRange
from model_service.linear.planner import KERNEL_MODES, ModelLinears, plan_model, resolve_mode
from model_service.linear.product import PlannedLinear, PlannedProduct

__all__ = ["KERNEL_MODES", "MODES", "LinearPlan", "ModelLinears", "PlannedLinear", "PlannedProduct", "RowRange",
           "plan_model", "resolve_mode"]
