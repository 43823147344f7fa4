"""Type stubs of the compiled binding (rust_core/py). tests/test_stubs.py
checks them against the built module, so they cannot drift."""

__version__: str

def profile_canonical(text: str, source: str | None = None) -> str: ...
def profile_sha256(text: str) -> str: ...
def profile_model_state_bytes(text: str) -> float: ...
def topology_from_spec(spec: str) -> str: ...
def topology_canonical(text: str, source: str | None = None) -> str: ...
def topology_describe(text: str) -> str: ...
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
) -> str: ...
def plan_canonical(text: str, source: str | None = None) -> str: ...
def plan_evaluate(plan_text: str, profile_text: str, plan_source: str | None = None) -> str: ...
def plan_blocks_per_stage(plan_text: str, profile_text: str) -> list[int]: ...
def plan_search(
    profile_text: str,
    topology_text: str,
    global_batch_size: int,
    *,
    warmup_policy: str = "auto",
    min_micro_batch_size: int | None = None,
    micro_batch_sizes: list[int] | None = None,
    search_space: str = "auto",
    profile_path: str | None = None,
) -> tuple[str, tuple[list[int], int, int]]: ...
def warmup_policies() -> list[str]: ...
def plan_choose_warmups(plan_text: str, profile_text: str, plan_source: str | None = None) -> str | None: ...
def plan_simulate(
    plan_text: str,
    profile_text: str,
    *,
    schedule: str | None = None,
    recompute: bool = False,
    overlap_allreduce: bool = True,
    plan_source: str | None = None,
) -> str: ...
def plan_baseline(
    kind: str,
    profile_text: str,
    topology_text: str,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
    warmup_policy: str = "auto",
) -> str: ...
def schedule_actions(
    kind: str,
    num_stages: int,
    micro_batches: int,
    warmup: list[int | None] | None = None,
    warmup_policy: str = "A",
) -> list[list[str]]: ...
def schedule_validate(lists: list[list[str]], micro_batches: int) -> None: ...
