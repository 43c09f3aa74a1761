"""SpecOffload planner: picks batch sizes and draft length from a measured profile (next issues).

Never imports the runtime's executors or Ray.
"""
