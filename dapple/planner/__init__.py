"""dapple's plan API. A planner for training large neural networks on many
GPUs: pipeline, data, tensor, context and expert parallelism, ZeRO or FSDP
sharding, re-computation, offloading and the pipeline schedule, after
DAPPLE, Whale and XPipe.

    from dapple import planner
    p = planner.plan(planner.Profile.example("artifact/bert-48-pbs-2"), "2x8-nvlink", global_batch_size=64)
    print(p.layout, p.iteration_ms)   # simulated iteration, the planner's objective

Planning needs no torch; the runtime and profiler import it lazily.
"""

try:
    from ._core import ASYNCHRONOUS_SCHEDULES, CHUNKED_SCHEDULES, SCHEDULE_KINDS, RunMetrics, __version__
except ImportError as e:  # pragma: no cover - depends on how it was installed
    import os as _os

    raise ImportError(
        f"dapple's compiled core (dapple.planner._core) is missing from {_os.path.dirname(__file__)}, and no "
        "installed copy of dapple is on the path: install with `pip install .`, or `pip install -e .` to work in "
        "the source tree."
    ) from e
from .calibrate import Calibration, calibrate
from .compare import BASELINES, baseline, compare, layout_plan, megatron_plan
from .errors import (
    DappleError,
    DappleIOError,
    IncompatibleInputsError,
    InfeasibleError,
    InvalidInputError,
    LimitExceededError,
    RunFailedError,
)
from .plan import GRAD_REDUCE_OVERLAPS, SEARCH_SPACES, STAGE_SHAPES, WARMUP_POLICIES, Plan, SearchStats, choose_warmups, chunked, evaluate
from .profile import (
    ATTENTION_KERNELS,
    EXAMPLE_PROFILES,
    GRADIENT_PRECISIONS,
    MODEL_CONFIGS,
    HOST_US_PER_KERNEL,
    TOKEN_DISPATCHERS,
    Profile,
    calibrate_stored_activations,
    import_artifact_profile,
    merge_profiles,
    transformer_profile,
)
from .simulation import Simulation, simulate
from .sweep import Sweep, SweepPoint, sweep
from .targets import TARGETS, ForTarget, plan, plan_for
from .topology import GPU_TYPES, PRESETS, Topology

__all__ = [
    "__version__",
    "ASYNCHRONOUS_SCHEDULES",
    "BASELINES",
    "EXAMPLE_PROFILES",
    "DappleError",
    "DappleIOError",
    "IncompatibleInputsError",
    "InfeasibleError",
    "InvalidInputError",
    "LimitExceededError",
    "Plan",
    "PRESETS",
    "GPU_TYPES",
    "Profile",
    "RunFailedError",
    "RunMetrics",
    "SCHEDULE_KINDS",
    "CHUNKED_SCHEDULES",
    "SEARCH_SPACES",
    "STAGE_SHAPES",
    "GRAD_REDUCE_OVERLAPS",
    "SearchStats",
    "Simulation",
    "Topology",
    "WARMUP_POLICIES",
    "Calibration",
    "calibrate",
    "calibrate_stored_activations",
    "choose_warmups",
    "chunked",
    "baseline",
    "compare",
    "evaluate",
    "import_artifact_profile",
    "transformer_profile",
    "MODEL_CONFIGS",
    "HOST_US_PER_KERNEL",
    "ATTENTION_KERNELS",
    "TOKEN_DISPATCHERS",
    "GRADIENT_PRECISIONS",
    "merge_profiles",
    "layout_plan",
    "megatron_plan",
    "plan",
    "plan_for",
    "TARGETS",
    "ForTarget",
    "simulate",
    "sweep",
    "Sweep",
    "SweepPoint",
]
