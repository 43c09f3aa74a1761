"""Developer scripts: run them from the repository root as ``python -m scripts.<name>``.

They import each other as a package (``from scripts.get_models import model_dir``); the package is not in
the wheel, which holds ``specoffload`` only.

Models
    get_models          fetch, verify and convert the real Qwen2.5-Coder target / draft pair
    make_tiny_models    tiny random checkpoints for the tests (``tests/conftest.py``) and local runs
    make_moe            MoE targets built from the dense target: upcycled (exact) and MoEfied (``moe/``)

Benchmarks (results in ``docs/perf/``: a JSON each and a section of its README.md)
    bench_generate      transformers vs our in-process Engine, with and without the draft
    bench_offload       the offloaded engine vs transformers + accelerate disk offload
    bench_ray_backend   the Ray backend vs the local one on one offloaded workload
    bench_transport     tensor handoff: shm arena + ZeroMQ header vs Ray's object store vs memcpy
    validate_planner    the planner's pick and predictions vs a measured grid
    hf_disk_offload     the accelerate disk-offload baseline (library for bench_offload, and a smoke check)

Shared by them
    common              results folder, page-cache drop, JSON result file, median and spread
    readme_section      rewrite one marked section of a README

Shell: ``setup_venv.sh`` (the virtual environment), ``test.sh`` (ruff + tests), ``demo.sh`` (the demo).
"""
