"""dapple: a planner for pipeline, data, tensor, context and expert parallel training.

One installed top-level package, so that nothing it ships can collide with
another package of the same name: `dapple.planner` (the plan API, profiler
and runtime) and `dapple.cli` (the `dapple` command). The repository keeps
them as the top-level folders `planner/` and `cli/`, links to these.
"""
