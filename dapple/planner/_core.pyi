"""Type stubs of the compiled binding (rust_core/py). tests/test_stubs.py
checks them against the built module, so they cannot drift."""

from typing import Any

__version__: str
WARMUP_POLICIES: tuple[str, ...]
BASELINES: tuple[str, ...]
SEARCH_SPACES: tuple[str, ...]
STAGE_SHAPES: tuple[str, ...]
GRAD_REDUCE_OVERLAPS: tuple[str, ...]
ATTENTION_KERNELS: tuple[str, ...]
TOKEN_DISPATCHERS: tuple[str, ...]
GRADIENT_PRECISIONS: tuple[str, ...]
CHUNKED_SCHEDULES: tuple[str, ...]
SCHEDULE_KINDS: tuple[str, ...]
PRECISIONS: tuple[str, ...]
ASYNCHRONOUS_SCHEDULES: tuple[str, ...]
SEARCHED_SCHEDULES: tuple[str, ...]
ASYNCHRONOUS_ROWS_ON: str
EXACT_MEMORY_SOURCE: str
SCHEDULE_PREDICTORS: dict[str, str]
PLACEMENT_POLICIES: tuple[str, ...]
PRESETS: dict[str, str]
ERROR_CODES: tuple[str, ...]
MODEL_CONFIGS: tuple[str, ...]
HOST_US_PER_KERNEL: float
GPU_TYPES: dict[str, dict[str, Any]]
MAX_PASSES: int
MAX_PASSES_CEILING: int
DEFAULT_MAX_SEARCH_BYTES: int
DEFAULT_MAX_SEARCH_STEPS: int
FORMATS: dict[str, tuple[int, list[int]]]

class Profile:
    source: str | None
    sha256: str
    model: str
    device: str | None
    num_layers: int
    batch_sizes: list[int]
    devices: list[str | None]
    @staticmethod
    def from_json(text: str, source: str | None = None) -> Profile: ...
    @staticmethod
    def from_dict(data: Any, source: str | None = None) -> Profile: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> dict: ...
    def model_state_bytes(self) -> float: ...
    def calibrated_stored_activations(self, peak_memory_bytes: float, batch_size: int) -> Profile: ...
    def with_times_of(self, other: Profile) -> Profile: ...

class Topology:
    source: str | None
    name: str
    num_devices: int
    num_machines: int
    @staticmethod
    def from_spec(spec: str) -> Topology: ...
    @staticmethod
    def from_json(text: str, source: str | None = None) -> Topology: ...
    @staticmethod
    def from_dict(data: Any, source: str | None = None) -> Topology: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> dict: ...
    def machine_of(self, device: int) -> int | None: ...
    def allreduce_ms(self, devices: list[int], bytes: float) -> float: ...
    def describe(self) -> str: ...

class Plan:
    source: str | None
    shape: str
    layout_kind: str
    num_stages: int
    micro_batch_size: int
    micro_batches: int
    global_batch_size: int
    model: str
    schedule_kind: str
    warmup_policy: str
    overlap_grad_reduce: str
    overlap_param_gather: bool
    hides_grad_reduce: bool
    hides_param_gather: bool
    chunks: int
    stage_ranks: list[int]
    iteration_ms: float | None
    topology: Topology
    @staticmethod
    def from_json(text: str, source: str | None = None) -> Plan: ...
    @staticmethod
    def from_dict(data: Any, source: str | None = None) -> Plan: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> dict: ...
    def stage_shapes(self) -> list[StageShape]: ...
    def blocks_per_stage(self, profile: Profile) -> list[int]: ...
    def pipeline_order(self) -> PipelineOrder: ...
    def actions(self, schedule: str | None = None, mini_batches: int | None = None) -> list[list[Action]]: ...
    def weights_table(self, schedule: str | None = None, mini_batches: int | None = None) -> str: ...
    def pass_weights(self, schedule: str | None = None, mini_batches: int | None = None) -> list[list[Pass]]: ...
    def layout(self) -> RunLayout: ...

class StageShape:
    """A stage's split degree, sequence parallelism, data replicas (its
    GPUs / (t c)), context degree c (each sample's sequence cut over c
    consecutive split groups), sharding level, re-computation ("none", "full", "per-layer" or
    "selective"), expert degree (the routed experts over groups of that
    many consecutive replicas; 1: none), expert tensor degree (the GPUs
    each routed expert's columns are split over), where the optimizer
    lives ("none": the GPUs; "optimizer": host memory), split groups (each
    replica's t consecutive devices) and expert groups (shard k of e
    consecutive expert replicas), from ``Plan.stage_shapes``."""

    tensor_parallel: int
    sequence_parallel: bool
    replicas: int
    weight_replicas: int
    context_parallel: int
    shard_level: int
    reshard_after_forward: bool
    recompute: str
    expert_parallel: int
    expert_tensor_parallel: int
    offload: str
    is_plain: bool
    split_groups: list[list[int]]
    expert_groups: list[list[int]]

class Action:
    """``F3``, ``B2``, ``AR``, ``OPT``: hashable, printable, picklable;
    ``Action(kind, micro_batch=None)``."""

    kind: str
    micro_batch: int | None
    @staticmethod
    def parse(text: str) -> Action: ...

class Pass:
    """An action with the weights of a forward or backward (None for AR and
    OPT) and the stage it computes; ``Pass(action, weights=None, stage=0)``,
    weights ``(mini_batch, live_version, base_version, predicted_updates)``."""

    action: Action
    stage: int
    mini_batch: int | None
    live_version: int | None
    base_version: int | None
    predicted_updates: int | None

class StageAction:
    """torch's ``_Action`` notation (``1F3``): stage, computation ("F", "B",
    "I" or "W") and micro-batch; hashable, printable, picklable."""

    stage: int
    computation: str
    micro_batch: int
    @staticmethod
    def parse(text: str) -> StageAction: ...

class PipelineOrder:
    """Every rank's actions over stages it may hold several of, validated."""

    micro_batches: int
    stage_ranks: list[int]
    rank_actions: list[list[StageAction]]
    @staticmethod
    def interleaved_1f1b(ranks: int, micro_batches: int, chunks: int) -> PipelineOrder: ...
    @staticmethod
    def interleaved_zero_bubble(ranks: int, micro_batches: int, chunks: int) -> PipelineOrder: ...
    @staticmethod
    def zbv(ranks: int, micro_batches: int) -> PipelineOrder: ...
    @staticmethod
    def zb_h2(ranks: int, micro_batches: int) -> PipelineOrder: ...
    @staticmethod
    def dualpipev(ranks: int, micro_batches: int) -> PipelineOrder: ...
    @staticmethod
    def from_csv(text: str, micro_batches: int) -> PipelineOrder: ...
    def to_csv(self) -> str: ...
    def rank_cells(self) -> list[list[str]]: ...

class Peer:
    rank: int
    start: int
    end: int

class ReplicaLayout:
    """One rank of a stage: shard ``shard`` at context rank ``context`` of
    replica ``replica``."""

    rank: int
    replica: int
    shard: int
    context: int
    start: int
    end: int
    receives_from: list[Peer]
    sends_to: list[Peer]
    gradients_to: list[Peer]
    gradients_from: list[Peer]

class StageLayout:
    layer_start: int
    layer_end: int
    replicas: list[ReplicaLayout]
    actions: list[Action]
    tensor_parallel: int
    shard_level: int
    reshard_after_forward: bool
    recompute: bool
    recompute_per_layer: bool
    split_groups: list[list[int]]
    replica_groups: list[list[int]]
    context_parallel: int
    context_groups: list[list[int]]
    expert_parallel: int
    expert_groups: list[list[int]]
    expert_replica_groups: list[list[int]]
    offload_optimizer: bool

class RunLayout:
    devices: tuple[int, ...]
    micro_batch_size: int
    micro_batches: int
    stages: tuple[StageLayout, ...]
    world_size: int
    global_batch_size: int
    @staticmethod
    def from_json(text: str) -> RunLayout: ...
    def to_json(self) -> str: ...
    def where(self, rank: int) -> tuple[int, int]: ...
    def positions(self, rank: int) -> list[tuple[int, int]]: ...

class Simulation:
    source: str | None
    iteration_ms: float
    peak_memory_bytes: float
    fits_memory: bool
    schedule: str
    recompute: bool
    mini_batches: int
    span_ms: float | None
    stages: list[dict]
    stage_ranks: list[int]
    tasks: list[dict]
    @staticmethod
    def from_json(text: str, source: str | None = None) -> Simulation: ...
    @staticmethod
    def from_dict(data: Any, source: str | None = None) -> Simulation: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> dict: ...

class RunMetrics:
    source: str | None
    steps: int
    @staticmethod
    def from_json(text: str, source: str | None = None) -> RunMetrics: ...
    @staticmethod
    def from_dict(data: Any, source: str | None = None) -> RunMetrics: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> dict: ...

class RegressSuite:
    source: str | None
    num_cases: int
    @staticmethod
    def from_json(text: str, source: str | None = None) -> RegressSuite: ...
    @staticmethod
    def from_dict(data: Any, source: str | None = None) -> RegressSuite: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> dict: ...

def import_artifact_profile(
    text: str,
    *,
    model: str,
    batch_size: int,
    source: str | None = None,
    param_bytes_scale: float = 1.0,
    block_pattern: str | None = None,
    origin: str | None = None,
    device: str | None = None,
    optimizer: str = "adam",
) -> Profile: ...
def transformer_profile(
    *,
    model: str,
    gpu: str,
    seq_len: int,
    micro_batch_sizes: list[int],
    efficiency: float | None = None,
    attention: str | None = None,
    expert_imbalance: float = 1.0,
    dispatcher: str = "all-to-all",
    gradients: str = "bf16",
    host_us_per_kernel: float | None = None,
    name: str | None = None,
    text: str | None = None,
    source: str | None = None,
) -> Profile: ...
def gemm_ms(gpu: str, m: int, n: int, k: int, *, batch: int = 1, fed_tile_intensity: float | None = None) -> float: ...
def memory_ms(gpu: str, bytes: float) -> float: ...
def megatron_plan(
    profile: Profile,
    topology: Topology,
    global_batch_size: int,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    micro_batch_size: int,
    shard_level: int = 0,
    reshard_after_forward: bool = False,
    sequence_parallel: bool = False,
    recompute: str = "none",
    overlap_grad_reduce: str = "data-parallel",
    overlap_param_gather: bool = False,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    offload: str = "none",
    context_parallel: int = 1,
) -> Plan: ...
def transformer_splits(
    *, hidden: int, ffn: int, heads: int, vocabulary: int, positions: int, seq_len: int, value_bytes: float,
    experts: int = 0, experts_per_token: int = 0, expert_ffn: int = 0,
) -> dict[str, dict]: ...
def check_memory_floor(
    profile: Profile, topology: Topology, global_batch_size: int, *, min_micro_batch_size: int | None = None
) -> None: ...

def search(
    profile: Profile,
    topology: Topology,
    global_batch_size: int,
    *,
    warmup_policy: str = "auto",
    min_micro_batch_size: int | None = None,
    micro_batch_sizes: list[int] | None = None,
    search_space: str = "auto",
    stage_shapes: str = "auto",
    max_shard_level: int = 1,
    max_context_parallel: int | None = None,
    max_search_bytes: int | None = None,
    max_search_steps: int | None = None,
    refine: bool = True,
    schedule: str | None = None,
    chunks: int | None = None,
    stages: int | None = None,
    micro_batches: int | None = None,
    cuts: list[int] = ...,
    ranges: list[tuple[int, int, int, int | None]] = ...,
    overlap_grad_reduce: str = "data-parallel",
    overlap_param_gather: bool = False,
) -> tuple[Plan, tuple[list[int], int, int, list[int]]]: ...
def evaluate(plan: Plan, profile: Profile) -> Plan: ...
def choose_warmups(plan: Plan, profile: Profile) -> Plan | None: ...
def fastest_valid_warmups(plan: Plan, profile: Profile, max_vectors: int) -> tuple[list[int], float, int] | None: ...
def calibrate(plan: Plan, metrics: RunMetrics, profile: Profile) -> tuple[Profile, list[dict]]: ...
def simulate(
    plan: Plan,
    profile: Profile,
    *,
    schedule: str | None = None,
    recompute: bool = False,
    overlap_allreduce: bool = True,
) -> Simulation: ...
def chunked_plan(plan: Plan, profile: Profile, schedule: str, chunks: int | None = None) -> Plan: ...
def baseline_plans(
    kind: str,
    profile: Profile,
    topology: Topology,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
    warmup_policy: str = "auto",
    overlap_grad_reduce: str = "data-parallel",
    overlap_param_gather: bool = False,
) -> list[Plan]: ...
def baseline_plan(
    kind: str,
    profile: Profile,
    topology: Topology,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
    warmup_policy: str = "auto",
    overlap_grad_reduce: str = "data-parallel",
    overlap_param_gather: bool = False,
) -> Plan: ...
def asynchronous_plan(
    schedule: str,
    profile: Profile,
    topology: Topology,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
) -> Plan: ...
def layout_plan(
    profile: Profile,
    topology: Topology,
    global_batch_size: int,
    stages: list[tuple[int, int, list[int]]],
    *,
    schedule: str = "early-backward-1f1b",
    warmup_policy: str = "auto",
    min_micro_batch_size: int | None = None,
    made_by: str = "layout",
) -> Plan: ...
def schedule_actions(
    kind: str, num_stages: int, micro_batches: int, warmup: list[int] | None = None, mini_batches: int = 1
) -> list[list[Action]]: ...
def schedule_validate(lists: list[list[Action]], micro_batches: int) -> None: ...
def set_max_passes(passes: int) -> None: ...

def autocast_parameter_state(optimizer: str) -> dict[str, float] | None: ...
