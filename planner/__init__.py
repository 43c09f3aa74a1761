"""SpecOffload planner: picks the batch size and draft length k from a measured hardware profile.

Pure: it reads shapes, budgets and a profile, and returns typed plans. It is also the project's base layer: no
torch, never `specoffload.runtime` or Ray (a test imports it in a fresh interpreter and checks `sys.modules`).

    errors.py       SpecOffloadError, the base of every user-facing error
    units.py        memory sizes: parse "4GiB", format bytes, the machine's RAM
    shapes.py       PartKey (a loadable part of a model) and ModelShape (parts, bytes, KV bytes per token)
    placement.py    where each part and cache lives under the memory budgets (pure arithmetic)
    kv_budget.py    rows of target KV a budget holds: paged by expected use versus reserved at max_seq_len

    profile.py      HardwareProfile: measured io / attention / FFN / draft costs, JSON with provenance
    acceptance.py   expected tokens per verify round (Leviathan et al. 2023, eq. 1); alpha estimation
    cost.py         ModelCosts (FLOPs from shapes), the step and workload time model
    search.py       Policy, search over (batch, k) (maximin over an alpha range), replan online, whether a
                    running job's re-placement pays
    paper_scale/    inputs and script of the paper-scale *prediction* (Mixtral 8x7B + Mistral 7B, RTX 4090)
"""

from .acceptance import (
    AcceptanceEstimate,
    AcceptanceTracker,
    RaggedAcceptance,
    estimate_alpha,
    estimate_alpha_by_prompt,
    expected_tokens,
)
from .cost import ModelCosts, StepEstimate, Workload, WorkloadEstimate, estimate_step, estimate_workload
from .profile import HardwareProfile, ProfileError
from .search import (
    NoFeasiblePolicyError,
    Policy,
    Replan,
    SearchResult,
    SearchSpace,
    replacement_pays,
    replan,
    search,
)

__all__ = [
    "AcceptanceEstimate",
    "AcceptanceTracker",
    "RaggedAcceptance",
    "HardwareProfile",
    "ModelCosts",
    "NoFeasiblePolicyError",
    "Policy",
    "Replan",
    "ProfileError",
    "SearchResult",
    "SearchSpace",
    "StepEstimate",
    "Workload",
    "WorkloadEstimate",
    "estimate_alpha",
    "estimate_alpha_by_prompt",
    "estimate_step",
    "estimate_workload",
    "expected_tokens",
    "replacement_pays",
    "replan",
    "search",
]
